//! The scores' additive bias through case files and the campaign (issue 35, item 2;
//! `docs/semantics.md` §1.9): the generator's bias cases round-trip through their case files
//! with their dBias, a file that breaks a rule is refused naming the tensor, the index and the
//! value, and the CPU backend passes every property on them. An outside worker that declares
//! `caps.dbias` (the adapter kit's numpy reference) has its dBias judged.

#[path = "support/python_kit.rs"]
mod python_kit;
use python_kit::python_kit;

use smallseq::backend::cpu::CpuBackend;
use smallseq::case::Case;
use smallseq::case_file::{case_bytes, parse_case, OutputPrecision};
use smallseq::config::Bias;
use smallseq::dispatch::Profile;
use smallseq::harness::campaign::case_seed;
use smallseq::harness::gen::{build, draw_geometry_for};
use smallseq::harness::props::Checker;
use smallseq::harness::rng::Rng;
use smallseq_reference::AttnBias;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

/// The first `n` cases of a campaign of `seed` whose bias §1.9 defines (a post-scale tensor
/// or ALiBi), as the campaign draws them.
fn bias_cases(seed: u64, n: usize) -> Vec<Case> {
    (0..20_000)
        .filter_map(|i| {
            let cs = case_seed(seed, i);
            let g = draw_geometry_for(&mut Rng::new(cs), Profile::Native);
            matches!(g.config.bias, Bias::PostScale(_) | Bias::Alibi)
                .then(|| build(&g, cs ^ 0xda7a).unwrap())
        })
        .take(n)
        .collect()
}

#[test]
fn bias_cases_round_trip_with_their_dbias_and_pass_every_property() {
    let cases = bias_cases(5, 40);
    assert_eq!(cases.len(), 40);
    let be = CpuBackend::default();
    let checker = Checker::isolated(&be);
    let (mut alibi, mut tensors, mut with_dbias) = (0, 0, 0);
    for (i, case) in cases.iter().enumerate() {
        let mut stored = case.clone();
        let pair = smallseq::runner::run_pair(&be, case, &Default::default()).unwrap();
        stored.outputs = pair.outputs();
        with_dbias += usize::from(stored.outputs.dbias.is_some());
        let back = parse_case(&case_bytes(&stored, OutputPrecision::Device).unwrap(), "x").unwrap();
        // NaN entries (unread) compare bitwise.
        assert_eq!(back.config.to_json(), stored.config.to_json(), "case {i}");
        assert_eq!(bias_bits(&back), bias_bits(&stored), "case {i}");
        assert!(back.outputs.bitwise_eq(&stored.outputs), "case {i}");
        match &case.config.params.bias {
            AttnBias::Alibi(_) => alibi += 1,
            AttnBias::PostScale(_) => tensors += 1,
            AttnBias::None => panic!("case {i} lost its bias"),
        }
        let run = checker.check(case, i as u64).unwrap();
        for (p, o) in &run.outcomes {
            assert!(
                !matches!(o, smallseq::harness::props::Outcome::Fail(_)),
                "case {i}: {p} failed: {o:?}"
            );
        }
    }
    assert!(
        alibi > 0 && tensors > 0 && with_dbias > 0,
        "{alibi} {tensors} {with_dbias}"
    );
}

fn bias_bits(c: &Case) -> Vec<u32> {
    match &c.config.params.bias {
        AttnBias::PostScale(t) => t.iter().map(|x| x.to_bits()).collect(),
        AttnBias::Alibi(s) => s.iter().map(|x| x.to_bits()).collect(),
        AttnBias::None => Vec::new(),
    }
}

/// A one-slot case of two heads with a `[1, 1, 2, 3]` post-scale bias.
fn small_case() -> Case {
    let mut cfg = smallseq::config::AttnConfig::new(
        smallseq_reference::Dtype::F32,
        2,
        4,
        smallseq_reference::Mask::Padding,
    );
    cfg.bias = Bias::PostScale(smallseq::config::BiasShape::OneOneSs);
    cfg.params.bias = AttnBias::PostScale(Arc::new(ndarray::Array4::zeros((1, 1, 2, 3))));
    let layout = smallseq_reference::Layout::packed(&[(2, 3)]);
    let q = ndarray::Array3::from_elem((2, 2, 4), 0.5f32);
    let k = ndarray::Array3::from_elem((3, 2, 4), 0.25f32);
    let v = k.clone();
    Case::new(cfg, layout, q, k, v, None).unwrap()
}

#[test]
fn a_file_that_breaks_a_bias_rule_is_refused_naming_the_tensor_index_and_value() {
    let case = small_case();
    let bytes = case_bytes(&case, OutputPrecision::Device).unwrap();
    assert!(parse_case(&bytes, "ok").is_ok());
    // +inf where row 1 sees key 2.
    let mut bad = case.clone();
    let mut t = ndarray::Array4::<f32>::zeros((1, 1, 2, 3));
    t[[0, 0, 1, 2]] = f32::INFINITY;
    bad.config.params.bias = AttnBias::PostScale(Arc::new(t));
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("tensor bias[0, 0, 1, 2] = inf"), "{e}");
    // A shape of another broadcast than the config names.
    let mut bad = case.clone();
    bad.config.bias = Bias::PostScale(smallseq::config::BiasShape::OneHss);
    let e = bad.validate().unwrap_err().to_string();
    assert!(
        e.contains("shape [1, 1, 2, 3] does not match bias_shape = 1hss ([1, 2, Sq, Sk])"),
        "{e}"
    );
    // Keys shorter than the longest slot.
    let mut bad = case.clone();
    bad.config.params.bias = AttnBias::PostScale(Arc::new(ndarray::Array4::zeros((1, 1, 2, 2))));
    let e = bad.validate().unwrap_err().to_string();
    assert!(
        e.contains("tensor bias: shape [1, 1, 2, 2] does not fit"),
        "{e}"
    );
    // The config names a bias the file does not carry, and a file carries a bias its config
    // does not name.
    let mut none = case.clone();
    none.config.params.bias = AttnBias::None;
    none.config.bias = Bias::None;
    let e = parse_case(&with_bias_key(&none, "\"alibi\""), "f").unwrap_err();
    assert!(
        e.to_string().contains("tensor 'alibi_slopes' is missing"),
        "{e}"
    );
    let e = parse_case(&with_bias_key(&case, "\"none\",\"x\":0"), "f");
    assert!(e.is_err());
    let mut plain = case.clone();
    plain.config.bias = Bias::None;
    let e = parse_case(&with_bias_key(&plain, "\"none\""), "f").unwrap_err();
    assert!(
        e.to_string()
            .contains("tensor bias: present, but smallseq.config has bias = none"),
        "{e}"
    );
}

/// `case`'s file with its config's `bias` key set to the JSON `value` (and `bias_shape`
/// dropped), its tensors kept.
fn with_bias_key(case: &Case, value: &str) -> Vec<u8> {
    let bytes = case_bytes(case, OutputPrecision::Device).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    let mut cfg: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&meta["smallseq.config"]).unwrap();
    cfg.remove("bias_shape");
    let text = serde_json::Value::Object(cfg).to_string();
    let bias = text
        .split("\"bias\":")
        .nth(1)
        .and_then(|t| t.split([',', '}']).next())
        .unwrap()
        .to_string();
    meta.insert(
        "smallseq.config".into(),
        text.replace(&format!("\"bias\":{bias}"), &format!("\"bias\":{value}")),
    );
    safetensors::serialize(st.tensors(), &Some(meta)).unwrap()
}

/// An exec campaign of seed 6 (120 cases, 7 of them with a post-scale bias and a backward)
/// through `adapter` (a path under the repository, with its arguments): its exit status and
/// report.
fn exec_campaign(py: &str, adapter: &str, tag: &str) -> (Option<i32>, serde_json::Value) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-dbias-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let worker = format!("{py} {}/{adapter}", root.display());
    let o = Command::new(env!("CARGO_BIN_EXE_smallseq"))
        .args(["fuzz", "--backend", "exec", "--worker", &worker])
        .args([
            "--cases",
            "120",
            "--seed",
            "6",
            "--jobs",
            "2",
            "--shrink-time",
            "0s",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let text = std::fs::read_to_string(out.join("report.json")).unwrap_or_else(|e| {
        panic!(
            "{tag}: no report ({e}): {}",
            String::from_utf8_lossy(&o.stderr)
        )
    });
    let _ = std::fs::remove_dir_all(&out);
    (o.status.code(), serde_json::from_str(&text).unwrap())
}

/// `caps.dbias` end to end: the numpy reference declares it and passes with its dBias judged;
/// the same reference with dBias scaled by 5/4 fails on dBias alone; and with the capability
/// left out (an adapter written before it) the campaign does not ask for dBias and says so.
#[test]
fn an_exec_worker_that_declares_dbias_has_it_judged() {
    let Some(py) = python_kit() else {
        println!("SKIP: no Python with numpy and safetensors (SMALLSEQ_PYTHON)");
        return;
    };
    let not_covered = |r: &serde_json::Value| r["not_covered"].to_string();
    let (code, r) = exec_campaign(&py, "adapters/numpy_reference.py", "ref");
    assert_eq!(code, Some(0), "{}", r["failures"]);
    let numeric = r["properties"]["numeric_agreement"].clone();
    let judged = r["margins"]["dbias"]["n"].as_u64().unwrap_or(0);
    assert!(
        judged >= 5,
        "dBias judged in {judged} cases: {}",
        r["margins"]
    );
    assert!(
        !not_covered(&r).contains("caps.dbias"),
        "{}",
        not_covered(&r)
    );

    let (code, r) = exec_campaign(&py, "adapters/tests/planted.py --plant dbias", "planted");
    assert_eq!(code, Some(1), "a wrong dBias must fail the campaign");
    let failures = r["failures"].as_array().unwrap();
    assert!(failures.len() >= 3, "{failures:?}");
    for f in failures {
        assert_eq!(f["property"], "numeric_agreement", "{f}");
        assert!(f["detail"].as_str().unwrap().starts_with("dbias: "), "{f}");
    }

    let (code, r) = exec_campaign(
        &py,
        "adapters/tests/planted.py --plant undeclared-dbias",
        "undeclared",
    );
    assert_eq!(code, Some(0), "{}", r["failures"]);
    assert!(r["margins"].get("dbias").is_none(), "{}", r["margins"]);
    assert!(
        not_covered(&r).contains("caps.dbias"),
        "{}",
        not_covered(&r)
    );
    // The same cases ran and passed, bias cases included, judged without dBias.
    assert_eq!(r["properties"]["numeric_agreement"], numeric);
}
