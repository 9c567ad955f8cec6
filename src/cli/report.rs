//! `smallseq report`: one page over several runs.

use anyhow::Result;
use smallseq::report::{runs_page, write_atomic, Order};
use std::path::PathBuf;

/// Render one HTML page over several runs: trends of cases/s, failures and margin
/// percentiles, a table of the runs, and each run in full.
#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// Run directories (each holding a report.json), or report.json files.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// The page to write.
    #[arg(long, default_value = "smallseq-report.html")]
    pub out: PathBuf,
    /// Order of the runs: time (when each report.json was written) or name.
    #[arg(long, default_value = "time", value_parser = ["time", "name"])]
    pub order: String,
}

pub fn run(args: &ReportArgs) -> Result<i32> {
    let order = if args.order == "name" {
        Order::Name
    } else {
        Order::Time
    };
    let page = match runs_page(&args.runs, order) {
        Ok(p) => p,
        Err(e) => {
            tell!("smallseq: {e}");
            return Ok(super::EXIT_USAGE);
        }
    };
    write_atomic(&args.out, &page)?;
    say!("wrote {} ({} runs)", args.out.display(), args.runs.len());
    Ok(0)
}
