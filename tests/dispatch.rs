//! Both dispatch profiles, each rule on each side of its boundary; the gate must agree with
//! the surface table everywhere.

use smallseq::case::bshd_layout;
use smallseq::dispatch::{
    gate::Dispatcher, surface, Arch, Code, EnvView, Profile, RuntimeFacts, StaticFacts,
};
use smallseq::reference::{Dtype, Layout, Mask, Side, Window};
use smallseq::{AttnConfig, LayoutKind};

fn cfg(dtype: Dtype, h: usize, hkv: usize, d: usize) -> AttnConfig {
    let mut c = AttnConfig::new(dtype, h, d, Mask::Padding);
    c.params.num_kv_heads = hkv;
    c
}

fn env(pairs: &[(&str, &str)]) -> EnvView {
    EnvView::from_pairs(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
}

/// Decides with both encodings, asserts they agree, returns the sorted codes.
fn codes(
    profile: Profile,
    c: &AttnConfig,
    layout: &Layout,
    env: &EnvView,
    arch: &str,
) -> Vec<Code> {
    let arch: Arch = arch.parse().unwrap();
    let has_kernel = surface::NATIVE_ARCHES.contains(&arch.name());
    let d = Dispatcher {
        profile,
        arch: arch.clone(),
        env: env.clone(),
        backend_has_kernel: has_kernel,
        defects: Default::default(),
    };
    let rt = RuntimeFacts::new(c.layout, layout);
    let got = d.decide(&d.plan(c), &rt);
    let facts = StaticFacts {
        config: c,
        env,
        arch: &arch,
        backend_has_kernel: has_kernel,
    };
    let mut want: Vec<Code> = surface::evaluate(profile, &facts, Some(&rt))
        .iter()
        .map(|r| r.code)
        .collect();
    want.sort();
    assert_eq!(
        got.codes(),
        want,
        "gate vs surface for {profile} {c:?} {layout:?}"
    );
    want
}

fn lens(lq: usize, lk: usize) -> Layout {
    Layout::packed(&[(3, 4), (lq, lk), (1, 1)])
}

const TE_ENV: &[(&str, &str)] = &[("NVTE_FUSED_ATTN_CK_SMALLSEQ", "1")];

#[test]
fn length_boundaries_16_17_18_on_each_side() {
    let c = cfg(Dtype::Bf16, 16, 16, 128);
    for (profile, e, arch) in [
        (Profile::Native, env(&[]), "cpu"),
        (Profile::Te625, env(TE_ENV), "gfx942"),
    ] {
        for n in [16, 17] {
            assert!(codes(profile, &c, &lens(n, 5), &e, arch).is_empty());
            assert!(codes(profile, &c, &lens(5, n), &e, arch).is_empty());
        }
        assert_eq!(
            codes(profile, &c, &lens(18, 5), &e, arch),
            vec![Code::SeqlenQ]
        );
        assert_eq!(
            codes(profile, &c, &lens(5, 18), &e, arch),
            vec![Code::SeqlenKv]
        );
    }
}

#[test]
fn padded_span_18_with_length_17_splits_the_profiles() {
    let side = |len: i32, span: i32| Side {
        cu: vec![0, len],
        padded: Some(vec![0, span]),
        tokens: span as usize,
    };
    let layout = Layout::new(side(17, 18), side(3, 3)).unwrap();
    let c = cfg(Dtype::Bf16, 16, 16, 128);
    assert!(codes(Profile::Native, &c, &layout, &env(&[]), "cpu").is_empty());
    assert_eq!(
        codes(Profile::Te625, &c, &layout, &env(TE_ENV), "gfx942"),
        vec![Code::SeqlenQ]
    );
}

#[test]
fn heads_dims_dtypes() {
    let l = lens(4, 4);
    let e = env(&[]);
    assert_eq!(
        codes(Profile::Native, &cfg(Dtype::Bf16, 8, 2, 128), &l, &e, "cpu"),
        vec![Code::Gqa]
    );
    assert_eq!(
        codes(Profile::Native, &cfg(Dtype::Bf16, 3, 3, 64), &l, &e, "cpu"),
        vec![]
    );
    for (d, ok_native, ok_te) in [
        (64, true, false),
        (128, true, true),
        (192, false, false),
        (256, true, true),
        (512, false, false),
    ] {
        let nat = codes(Profile::Native, &cfg(Dtype::Bf16, 16, 16, d), &l, &e, "cpu");
        assert_eq!(nat.is_empty(), ok_native, "native d={d}");
        let te = codes(
            Profile::Te625,
            &cfg(Dtype::Bf16, 16, 16, d),
            &l,
            &env(TE_ENV),
            "gfx942",
        );
        assert_eq!(te.is_empty(), ok_te, "te625 d={d}");
    }
    let mut dv = cfg(Dtype::Bf16, 16, 16, 128);
    dv.params.head_dim_v = 64;
    assert_eq!(
        codes(Profile::Native, &dv, &l, &e, "cpu"),
        vec![Code::HeadDim]
    );
    for (dt, native, te) in [
        (Dtype::Bf16, true, true),
        (Dtype::F16, true, false),
        (Dtype::F32, false, false),
    ] {
        assert_eq!(
            codes(Profile::Native, &cfg(dt, 16, 16, 128), &l, &e, "cpu").is_empty(),
            native
        );
        assert_eq!(
            codes(
                Profile::Te625,
                &cfg(dt, 16, 16, 128),
                &l,
                &env(TE_ENV),
                "gfx942"
            )
            .is_empty(),
            te
        );
    }
    for h in [8, 16, 32, 64] {
        let te = codes(
            Profile::Te625,
            &cfg(Dtype::Bf16, h, h, 128),
            &l,
            &env(TE_ENV),
            "gfx942",
        );
        assert_eq!(te.is_empty(), h == 16 || h == 32, "te625 h={h}");
    }
}

#[test]
fn masks_and_windows() {
    let l = lens(4, 4);
    for m in Mask::ALL {
        let mut c = cfg(Dtype::Bf16, 16, 16, 128);
        c.params.mask = m;
        assert!(
            codes(Profile::Native, &c, &l, &env(&[]), "cpu").is_empty(),
            "native {m}"
        );
        let te = codes(Profile::Te625, &c, &l, &env(TE_ENV), "gfx942");
        let te_ok = matches!(
            m,
            Mask::NoMask | Mask::Padding | Mask::PaddingCausal | Mask::PaddingCausalBottomRight
        );
        assert_eq!(te.is_empty(), te_ok, "te625 {m}");
    }
    for w in [
        Window { left: 0, right: 0 },
        Window { left: 3, right: -1 },
        Window { left: -1, right: 2 },
    ] {
        let mut c = cfg(Dtype::Bf16, 16, 16, 128);
        c.params.window = w;
        assert_eq!(
            codes(Profile::Native, &c, &l, &env(&[]), "cpu"),
            vec![Code::Window]
        );
        // TE accepts any window and ignores it.
        assert!(codes(Profile::Te625, &c, &l, &env(TE_ENV), "gfx942").is_empty());
    }
}

#[test]
fn env_values() {
    let c = cfg(Dtype::Bf16, 16, 16, 128);
    let l = lens(4, 4);
    for (v, native_ok, te_ok) in [
        (Some("1"), false, true),
        (Some("0"), true, false),
        (Some("true"), false, false),
        (Some(" 1"), false, false),
        (None, true, false),
    ] {
        let nat = match v {
            Some(v) => env(&[("SMALLSEQ_FORCE_FALLBACK", v)]),
            None => env(&[]),
        };
        assert_eq!(
            codes(Profile::Native, &c, &l, &nat, "cpu").is_empty(),
            native_ok,
            "native {v:?}"
        );
        let te = match v {
            Some(v) => env(&[("NVTE_FUSED_ATTN_CK_SMALLSEQ", v)]),
            None => env(&[]),
        };
        assert_eq!(
            codes(Profile::Te625, &c, &l, &te, "gfx942").is_empty(),
            te_ok,
            "te625 {v:?}"
        );
    }
}

#[test]
fn arches() {
    let c = cfg(Dtype::Bf16, 16, 16, 128);
    let l = lens(4, 4);
    for (arch, native, te) in [
        ("cpu", true, false),
        ("sm_90", true, false),
        ("gfx942", true, true),
        ("gfx950", true, false),
        ("gfx1100", false, false),
    ] {
        assert_eq!(
            codes(Profile::Native, &c, &l, &env(&[]), arch).is_empty(),
            native,
            "native {arch}"
        );
        assert_eq!(
            codes(Profile::Te625, &c, &l, &env(TE_ENV), arch).is_empty(),
            te,
            "te625 {arch}"
        );
    }
}

#[test]
fn empty_batches_and_bshd() {
    let c = cfg(Dtype::Bf16, 16, 16, 128);
    let e = env(&[]);
    let b0 = Layout::packed(&[]);
    assert!(codes(Profile::Native, &c, &b0, &e, "cpu").contains(&Code::EmptyBatch));
    assert!(codes(Profile::Te625, &c, &b0, &env(TE_ENV), "gfx942").contains(&Code::EmptyBatch));
    let all_q_empty = Layout::packed(&[(0, 3), (0, 2)]);
    assert!(codes(Profile::Native, &c, &all_q_empty, &e, "cpu").contains(&Code::EmptyBatch));
    let mut bshd = c.clone();
    bshd.layout = LayoutKind::Bshd;
    assert!(codes(Profile::Native, &bshd, &bshd_layout(3, 1, 1), &e, "cpu").is_empty());
    assert_eq!(
        codes(
            Profile::Te625,
            &bshd,
            &bshd_layout(3, 1, 1),
            &env(TE_ENV),
            "gfx942"
        ),
        vec![Code::SeqlenQ, Code::SeqlenKv]
    );
    assert!(codes(
        Profile::Te625,
        &bshd,
        &bshd_layout(3, 17, 17),
        &env(TE_ENV),
        "gfx942"
    )
    .is_empty());
    assert_eq!(
        codes(Profile::Native, &bshd, &bshd_layout(3, 4, 5), &e, "cpu"),
        vec![Code::Layout]
    );
}
