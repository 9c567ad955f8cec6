//! Replays every committed fuzz seed through the same code the cargo-fuzz targets run, so a
//! regression on a seed fails the ordinary test run, not only a fuzzing session.
//!
//! `SMALLSEQ_WRITE_CORPUS=1 cargo test --release --test fuzz_corpus -- --ignored` regenerates
//! the seeds (deterministic: the same seeds every time).

use smallseq::case_file::{case_bytes, OutputPrecision};
use smallseq::harness::fuzz_input::{draw_config, reject_counts, run, Target};
use smallseq::harness::gen::{build, draw_geometry};
use smallseq::harness::oracles::Verdict;
use smallseq::harness::rng::Rng;
use std::path::{Path, PathBuf};

fn corpus_dir(t: Target) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(t.name())
}

#[test]
fn committed_seeds_pass_every_target() {
    std::env::set_var("SMALLSEQ_FUZZ_QUIET", "1");
    for t in Target::ALL {
        let dir = corpus_dir(t);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("corpus entry").path())
            .collect();
        files.sort();
        assert!(files.len() >= 8, "{t}: only {} seeds", files.len());
        let mut checked = 0;
        for f in &files {
            let bytes = std::fs::read(f).expect("seed readable");
            match run(t, &bytes) {
                Ok(Verdict::Checked) => checked += 1,
                Ok(Verdict::Rejected(_)) => {}
                Err(v) => panic!(
                    "{t} seed {} violates: {v}\nreproduce: cargo fuzz run {t} {}",
                    f.display(),
                    f.display()
                ),
            }
        }
        let rejects: Vec<String> = reject_counts()
            .into_iter()
            .filter(|((target, _), _)| *target == t)
            .map(|((_, why), n)| format!("{why}: {n}"))
            .collect();
        println!(
            "{t}: {} seeds, {checked} checked, rejected [{}]",
            files.len(),
            rejects.join("; ")
        );
        // A corpus that only exercises the domain's edges would test nothing.
        assert!(checked * 2 >= files.len(), "{t}: most seeds rejected");
    }
}

/// Seeds: random bytes of several lengths for every target, plus real inputs where the target
/// parses a format (config JSON, case files).
#[test]
#[ignore]
fn write_seed_corpus() {
    if std::env::var_os("SMALLSEQ_WRITE_CORPUS").is_none() {
        smallseq::print_skip(format_args!(
            "set SMALLSEQ_WRITE_CORPUS=1 to rewrite fuzz/corpus"
        ));
        return;
    }
    let mut rng = Rng::new(0x5eed_c0de);
    for t in Target::ALL {
        let dir = corpus_dir(t);
        std::fs::create_dir_all(&dir).expect("corpus dir");
        for (i, len) in [16usize, 32, 64, 128, 256, 512, 1024, 2048]
            .iter()
            .enumerate()
        {
            let bytes: Vec<u8> = (0..*len).map(|_| rng.next_u64() as u8).collect();
            std::fs::write(dir.join(format!("seed-random-{i}")), bytes).expect("write seed");
        }
    }
    let mut c_rng = Rng::new(11);
    let mut configs: Vec<String> = (0..6).map(|_| draw_config(&mut c_rng).to_json()).collect();
    configs.push(r#"{"dtype":"bf16","num_heads":3}"#.into());
    configs.push("[1,2,3]".into());
    let cl = corpus_dir(Target::ConfigLayout);
    for (i, c) in configs.iter().enumerate() {
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(c.as_bytes());
        std::fs::write(cl.join(format!("seed-config-{i}")), bytes).expect("write seed");
    }
    let cf = corpus_dir(Target::CaseFile);
    let mut written = 0;
    let mut g_rng = Rng::new(7);
    while written < 6 {
        let g = draw_geometry(&mut g_rng);
        let tokens = g.layout.q.tokens + g.layout.kv.tokens;
        let p = &g.config.params;
        if tokens > 40 || p.num_heads * p.head_dim_qk > 256 {
            continue;
        }
        let case = build(&g, g_rng.next_u64()).expect("generated case");
        let bytes = case_bytes(&case, OutputPrecision::Reference).expect("serialise");
        std::fs::write(cf.join(format!("seed-case-{written}")), &bytes).expect("write seed");
        written += 1;
    }
}
