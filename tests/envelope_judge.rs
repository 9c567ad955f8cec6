//! The judge of an implementation that declares no design (the envelope of the common
//! designs, docs/judgement.md §7), on outputs of `adapters/design_model.py --design fa2`: a
//! correct implementation that rounds where FlashAttention-2 does (P recomputed from the
//! stored LSE, D from the stored O, dS and each query head's dK/dV in f16). Seed 17's 150-case
//! campaign through it failed 8 cases on the project's judge; these three capsules are its
//! shrunk failures, stored with the model's outputs.
use smallseq::case_file::read_case;
use smallseq::harness::conditioning::DESIGN_KEY;
use smallseq::harness::repro::judge_stored;
use std::path::Path;

fn capsule(name: &str) -> smallseq::Case {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/capsules/stored");
    read_case(&dir.join(name)).unwrap()
}

fn judged_as(case: &smallseq::Case, design: &str) -> smallseq::harness::repro::Diagnosis {
    let mut c = case.clone();
    c.meta.insert(DESIGN_KEY.into(), design.into());
    judge_stored(&c).unwrap()
}

/// With exponents near 10⁵, P recomputed in f32 from the stored LSE lands about 12 f16 units
/// of P from the exact emulation; the tensor rule of the envelope takes the allowance for
/// another order off each element's error as the row rule does. The project's design, whose P
/// is the emulation's, still fails the same outputs.
#[test]
fn p_recomputed_from_the_lse_passes_the_envelope_and_fails_the_project_design() {
    for name in [
        "fa2-model-f16-dv-p-from-lse.safetensors",
        "fa2-model-dq-p-from-lse.safetensors",
    ] {
        let case = capsule(name);
        let env = judged_as(&case, "envelope");
        assert!(!env.failed, "{name}: {}", env.lines.join("\n"));
        let project = judged_as(&case, "project");
        assert!(project.failed, "{name}: {}", project.lines.join("\n"));
    }
}

/// A GQA case whose one query head's dK reaches 6.5e5 before the group is summed to a
/// finite value: an f16 partial overflows there, a range limit of the design the envelope
/// names (which intermediate, from what magnitude). Under the project's design, which sums the
/// group in f32, no emulation holds these infinities and it stays a numeric failure.
#[test]
fn an_overflowing_query_head_partial_of_dk_is_the_envelope_range_limit() {
    let case = capsule("fa2-model-f16-gqa-head-dk-overflow.safetensors");
    let env = judged_as(&case, "envelope");
    let text = env.lines.join("\n");
    assert!(
        text.contains("range limit of a 16-bit design")
            && text.contains("one query head's dK reaches"),
        "{text}"
    );
    let project = judged_as(&case, "project");
    let text = project.lines.join("\n");
    assert!(project.failed && !text.contains("range limit"), "{text}");
}
