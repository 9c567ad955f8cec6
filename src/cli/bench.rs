#![cfg_attr(not(feature = "cuda"), allow(dead_code, unused_imports))]
//! `smallseq bench`: times the CUDA small-seq and fallback kernels, forward and backward, on the
//! workloads of `shared/bench/peers-h200.md`, with CUDA events (median after warm-up), inputs
//! rotated across copies that together exceed the L2 several times, next to a device-to-device
//! copy moving the same bytes. Prints achieved bandwidth and the fraction of the copy; writes
//! JSON with `--out`.

use anyhow::{bail, Context, Result};
use smallseq::harness::rng::Rng;

/// Arguments of `smallseq bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Backend to time (only `cuda` has timed kernels).
    #[arg(long, default_value = "cuda")]
    pub backend: String,
    /// Timed repetitions per kernel (median reported).
    #[arg(long, default_value_t = 30)]
    pub iters: usize,
    /// Untimed repetitions first.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Only workloads whose name contains one of these (comma-separated).
    #[arg(long)]
    pub filter: Option<String>,
    /// Input sets together at least this many MB (rotated; H200 L2 is 50 MB).
    #[arg(long, default_value_t = 256)]
    pub rotate_mb: usize,
    /// Also time the fallback kernels on the small-seq workloads (`--fallback false`: not).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub fallback: bool,
    /// Time the forward kernels only (e.g. under a sanitizer, where the scalar fallback
    /// backward on 512-token sequences takes minutes).
    #[arg(long)]
    pub forward_only: bool,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// A benchmark workload: `slots` sequences, lengths drawn per side.
#[derive(Clone, Debug)]
pub struct Workload {
    pub name: &'static str,
    pub slots: usize,
    pub q_len: (usize, usize),
    pub kv_len: (usize, usize),
    pub heads: usize,
    pub head_dim: usize,
    /// Whether the small-seq kernels apply (max length <= 17).
    pub small: bool,
}

/// The four workloads of peers-h200.md, plus 512-token sequences for the fallback.
pub fn workloads() -> Vec<Workload> {
    let w = |name, slots, q_len, kv_len, heads, head_dim, small| Workload {
        name,
        slots,
        q_len,
        kv_len,
        heads,
        head_dim,
        small,
    };
    vec![
        w(
            "fix16_h16_d128_B4096",
            4096,
            (16, 16),
            (16, 16),
            16,
            128,
            true,
        ),
        w(
            "rnd1-17_h16_d128_B8192",
            8192,
            (1, 17),
            (1, 17),
            16,
            128,
            true,
        ),
        w(
            "rnd1-17_h32_d256_B4096",
            4096,
            (1, 17),
            (1, 17),
            32,
            256,
            true,
        ),
        w(
            "q1_kv2-16_h16_d128_B32768",
            32768,
            (1, 1),
            (2, 16),
            16,
            128,
            true,
        ),
        w(
            "fix512_h16_d128_B64",
            64,
            (512, 512),
            (512, 512),
            16,
            128,
            false,
        ),
    ]
}

/// A length in `lo..=hi` drawn by modulo, the same sequence `bench/peers.py` draws (its
/// splitmix64 is [`Rng`]'s).
fn modulo_range(r: &mut Rng, lo: usize, hi: usize) -> usize {
    lo + (r.next_u64() % (hi - lo + 1) as u64) as usize
}

/// Lengths of a workload (q then kv per slot), deterministic.
pub fn lengths(w: &Workload) -> Vec<(usize, usize)> {
    let mut r = Rng::new(1);
    (0..w.slots)
        .map(|_| {
            (
                modulo_range(&mut r, w.q_len.0, w.q_len.1),
                modulo_range(&mut r, w.kv_len.0, w.kv_len.1),
            )
        })
        .collect()
}

/// One timed figure.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Figure {
    pub workload: String,
    pub kernel: String,
    pub us: f64,
    pub bytes: u64,
    pub gb_s: f64,
    /// copy time of the same bytes / kernel time.
    pub copy_fraction: f64,
}

/// Runs the benchmark.
///
/// # Errors
/// No device, unknown backend, or a failed launch.
pub fn run(args: &BenchArgs) -> Result<()> {
    if args.backend != "cuda" {
        bail!(
            "bench: only --backend cuda has timed kernels (got {})",
            args.backend
        );
    }
    imp::run(args)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    pub fn run(_: &super::BenchArgs) -> anyhow::Result<()> {
        Err(smallseq::error::Error::NotCompiledWith { feature: "cuda" }.into())
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::{CudaSlice, DevicePtr};
    use smallseq::backend::gpu::cuda::{CudaBackend, LaunchDims, Ptrs};
    use smallseq_reference::Dtype;

    struct Set {
        q: CudaSlice<u16>,
        k: CudaSlice<u16>,
        v: CudaSlice<u16>,
        o: CudaSlice<u16>,
        lse: CudaSlice<f32>,
        d_o: CudaSlice<u16>,
        dq: CudaSlice<u16>,
        dk: CudaSlice<u16>,
        dv: CudaSlice<u16>,
        delta: CudaSlice<f32>,
        rowsum: CudaSlice<f32>,
    }

    fn rand_bf16(r: &mut Rng, n: usize) -> Vec<u16> {
        (0..n)
            .map(|_| {
                let x = (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                half::bf16::from_f32(x).to_bits()
            })
            .collect()
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    }

    pub fn run(args: &BenchArgs) -> Result<()> {
        let be = CudaBackend::new()?;
        be.warm_up()?;
        let st = be.stream().clone();
        let p = |s: &CudaSlice<u16>| s.device_ptr(&st).0;
        let pf = |s: &CudaSlice<f32>| s.device_ptr(&st).0;
        let mut figures: Vec<Figure> = Vec::new();
        say!("device arch {}", smallseq::backend::BackendInfo::arch(&be));
        say!(
            "{:28} {:22} {:>10} {:>9} {:>7}",
            "workload",
            "kernel",
            "us",
            "GB/s",
            "copy%"
        );
        for w in workloads() {
            if let Some(f) = &args.filter {
                if !f.split(',').any(|part| w.name.contains(part)) {
                    continue;
                }
            }
            let lens = lengths(&w);
            let tq: usize = lens.iter().map(|l| l.0).sum();
            let tk: usize = lens.iter().map(|l| l.1).sum();
            let (h, d) = (w.heads, w.head_dim);
            let mut cq = vec![0i32];
            let mut ck = vec![0i32];
            for &(a, b) in &lens {
                cq.push(cq.last().unwrap() + a as i32);
                ck.push(ck.last().unwrap() + b as i32);
            }
            let fwd_bytes = ((2 * tq * h * d + 2 * tk * h * d) * 2 + tq * h * 4) as u64;
            let bwd_bytes = ((4 * tq * h * d + 4 * tk * h * d) * 2 + tq * h * 4) as u64;
            let copies = ((args.rotate_mb as u64 * 1_000_000).div_ceil(fwd_bytes)).max(1) as usize;
            let mut rng = Rng::new(7);
            let cu_q = st.memcpy_stod(&cq)?;
            let cu_kv = st.memcpy_stod(&ck)?;
            let mut sets = Vec::new();
            for _ in 0..copies {
                let up = |n: usize, r: &mut Rng| st.memcpy_stod(&rand_bf16(r, n));
                sets.push(Set {
                    q: up(tq * h * d, &mut rng)?,
                    k: up(tk * h * d, &mut rng)?,
                    v: up(tk * h * d, &mut rng)?,
                    d_o: up(tq * h * d, &mut rng)?,
                    o: st.alloc_zeros::<u16>(tq * h * d)?,
                    lse: st.alloc_zeros::<f32>(tq * h)?,
                    dq: st.alloc_zeros::<u16>(tq * h * d)?,
                    dk: st.alloc_zeros::<u16>(tk * h * d)?,
                    dv: st.alloc_zeros::<u16>(tk * h * d)?,
                    delta: st.alloc_zeros::<f32>(tq * h)?,
                    rowsum: st.alloc_zeros::<f32>(tq * h)?,
                });
            }
            let dims = LaunchDims {
                dtype: Dtype::Bf16,
                out_f32: false,
                b: w.slots as i32,
                heads: h as i32,
                kv_heads: h as i32,
                dqk: d as i32,
                dv: d as i32,
                tq: tq as i64,
                tk: tk as i64,
                max_lq: lens.iter().map(|l| l.0).max().unwrap_or(0) as i32,
                max_lk: lens.iter().map(|l| l.1).max().unwrap_or(0) as i32,
                scale: 1.0 / (d as f32).sqrt(),
                mask: 0,
                window: (-1, -1),
                drop: smallseq::backend::launch::DropArgs::NONE,
                bias: smallseq::backend::launch::BiasArgs::NONE,
                // As the kernels were built (SMALLSEQ_KERNEL_DEFINES): the backward then
                // includes the D kernel, on the forward's O.
                d_from_o: be.d_from_o(),
            };
            let ptrs = |s: &Set| Ptrs {
                q: p(&s.q),
                k: p(&s.k),
                v: p(&s.v),
                o: p(&s.o),
                lse: pf(&s.lse),
                d_o: p(&s.d_o),
                dq: p(&s.dq),
                dk: p(&s.dk),
                dv: p(&s.dv),
                delta: pf(&s.delta),
                rowsum: pf(&s.rowsum),
                cu_q: cu_q.device_ptr(&st).0,
                cu_kv: cu_kv.device_ptr(&st).0,
                off_q: cu_q.device_ptr(&st).0,
                off_kv: cu_kv.device_ptr(&st).0,
                bias: 0,
                dbias: 0,
            };
            let all: Vec<Ptrs> = sets.iter().map(ptrs).collect();
            // A forward per set first, so the backward reads a real lse.
            for pp in &all {
                if w.small {
                    be.launch_small_seq_fwd(&dims, pp)?;
                } else {
                    be.launch_fallback_fwd(&dims, pp)?;
                }
            }
            be.sync()?;
            let time = |f: &dyn Fn(&Ptrs) -> smallseq::error::Result<()>| -> Result<f64> {
                for i in 0..args.warmup {
                    f(&all[i % all.len()])?;
                }
                let mut ts = Vec::new();
                for i in 0..args.iters {
                    let a = st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                    f(&all[i % all.len()])?;
                    let b = st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                    ts.push(a.elapsed_ms(&b)? as f64 * 1e3);
                }
                be.sync()?;
                Ok(median(ts))
            };
            // Same-bytes copy: reads and writes fwd_bytes / 2 each.
            let half = (fwd_bytes / 2 / 2) as usize;
            let src = st.alloc_zeros::<u16>(half)?;
            let mut dst = st.alloc_zeros::<u16>(half)?;
            let copy_us = {
                for _ in 0..args.warmup {
                    st.memcpy_dtod(&src, &mut dst)?;
                }
                let mut ts = Vec::new();
                for _ in 0..args.iters {
                    let a = st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                    st.memcpy_dtod(&src, &mut dst)?;
                    let b = st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                    ts.push(a.elapsed_ms(&b)? as f64 * 1e3);
                }
                median(ts)
            };
            drop((src, dst));
            let mut emit = |kernel: &str, us: f64, bytes: u64| {
                let copy_same = copy_us * bytes as f64 / fwd_bytes as f64;
                let f = Figure {
                    workload: w.name.into(),
                    kernel: kernel.into(),
                    us,
                    bytes,
                    gb_s: bytes as f64 / us / 1e3,
                    copy_fraction: copy_same / us,
                };
                say!(
                    "{:28} {:22} {:>10.1} {:>9.0} {:>6.1}%",
                    f.workload,
                    f.kernel,
                    f.us,
                    f.gb_s,
                    f.copy_fraction * 100.0
                );
                figures.push(f);
            };
            emit("copy_same_bytes", copy_us, fwd_bytes);
            if w.small {
                let t = time(&|pp| be.launch_small_seq_fwd(&dims, pp))?;
                emit("small_seq_fwd", t, fwd_bytes);
                if !args.forward_only {
                    let t = time(&|pp| be.launch_small_seq_bwd(&dims, pp))?;
                    emit("small_seq_bwd", t, bwd_bytes);
                }
            }
            if args.fallback || !w.small {
                let t = time(&|pp| be.launch_fallback_fwd(&dims, pp))?;
                emit("fallback_fwd", t, fwd_bytes);
                if !args.forward_only {
                    let t = time(&|pp| be.launch_fallback_bwd(&dims, pp))?;
                    emit("fallback_bwd", t, bwd_bytes);
                }
            }
        }
        if let Some(path) = &args.out {
            std::fs::write(path, serde_json::to_string_pretty(&figures)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}
