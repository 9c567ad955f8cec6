//! Fills the CUDA kernel cache without a GPU: NVRTC compiles both kernel files for an arch under
//! `SMALLSEQ_KERNEL_DEFINES` into `SMALLSEQ_KERNEL_CACHE` (or the default cache directory).
//! A GPU host that reads the same directory with the same NVRTC major.minor then starts without
//! compiling (tens of seconds a variant; docs/cuda.md, "Kernel cache").
//!
//! ```text
//! LD_LIBRARY_PATH=<dir of libnvrtc.so.13> SMALLSEQ_KERNEL_CACHE=target/kc \
//!   SMALLSEQ_KERNEL_DEFINES="FTB_SWIZZLE_MAX_D=128" \
//!   cargo run --release --features cuda --example fill_kernel_cache -- sm_90
//! ```
use smallseq::backend::gpu::cuda::fill_kernel_cache;
use smallseq::backend::kernel_cache::KernelCache;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [arch] = args.as_slice() else {
        eprintln!("usage: fill_kernel_cache ARCH   (sm_90: an H100 or H200)");
        std::process::exit(2);
    };
    let cache = KernelCache::from_env();
    match fill_kernel_cache(arch, &cache) {
        Ok(files) => {
            let dir = cache
                .dir()
                .map(|d| d.display().to_string())
                .unwrap_or_default();
            for (name, had) in files {
                let what = if had { "already there" } else { "compiled" };
                println!("{name} for {arch}: {what}, in {dir}");
            }
        }
        Err(e) => {
            eprintln!("fill_kernel_cache: {e}");
            std::process::exit(1);
        }
    }
}
