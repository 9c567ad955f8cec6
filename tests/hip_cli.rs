//! `smallseq fuzz --backend hip` where there is no AMD GPU (or no `hip` feature): exit status 2
//! and one line that says which of the two it is.
use std::process::Command;

#[test]
fn hip_backend_without_a_device_exits_2_with_one_line() {
    if std::path::Path::new("/dev/kfd").exists() && cfg!(feature = "hip") {
        smallseq::print_skip(format_args!(
            "an AMD GPU driver is present; the campaign would run"
        ));
        return;
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smallseq-hip-cli-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_smallseq"))
        .args(["fuzz", "--backend", "hip", "--cases", "1", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    if cfg!(feature = "hip") {
        assert!(err.contains("backend hip is not available"), "{err}");
    } else {
        assert!(err.contains("without the `hip` feature"), "{err}");
    }
}
