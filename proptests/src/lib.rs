//! Property suites over the smallseq library.
