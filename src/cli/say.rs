//! Output lines for the CLI that survive a closed pipe.

/// `println!` that survives a closed stdout: `smallseq fuzz … | head` must still check its
/// cases and write its reports (a failed write panicked, and the campaign was lost before its
/// first case).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// `eprintln!` that survives a closed stderr, as [`say!`].
macro_rules! tell {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}
