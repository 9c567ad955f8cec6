//! The GPU kernels' argument lists, shared by the CUDA and HIP backends: which kind of kernel
//! takes which pointers and scalars, in its parameters' order, from a launch's
//! [`LaunchDims`] and [`Ptrs`], and which of its tensors must sit on 16 bytes.

use super::launch::{LaunchDims, Ptrs};
use crate::error::Misaligned;

/// One kernel argument, kept alive until the launch returns. Both GPU backends launch with the
/// lists [`args_of`] builds, and `ci/hip-compile-check.sh` compares them with the arguments
/// the compiled kernels declare.
#[derive(Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// `P` for a pointer, else the size in bytes of the value: how the code object's
    /// metadata describes the argument (`global_buffer`, or `by_value` and its `.size`).
    pub fn code(&self) -> char {
        match self {
            Arg::Ptr(_) => 'P',
            Arg::I32(_) | Arg::F32(_) => '4',
            Arg::I64(_) => '8',
        }
    }
}

/// The kernel kinds, by argument list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    SmallSeqFwd,
    SmallSeqBwd,
    FallbackFwd,
    TiledFwd,
    FallbackBwdQ,
    FallbackBwdKv,
    TiledBwdQ,
    TiledBwdKv,
    FallbackDbias,
    FallbackDelta,
}

impl Kernel {
    /// The kind's name, as errors print it (`SmallSeqBwd`).
    pub fn name(self) -> &'static str {
        match self {
            Kernel::SmallSeqFwd => "SmallSeqFwd",
            Kernel::SmallSeqBwd => "SmallSeqBwd",
            Kernel::FallbackFwd => "FallbackFwd",
            Kernel::TiledFwd => "TiledFwd",
            Kernel::FallbackBwdQ => "FallbackBwdQ",
            Kernel::FallbackBwdKv => "FallbackBwdKv",
            Kernel::TiledBwdQ => "TiledBwdQ",
            Kernel::TiledBwdKv => "TiledBwdKv",
            Kernel::FallbackDbias => "FallbackDbias",
            Kernel::FallbackDelta => "FallbackDelta",
        }
    }
}

/// The arguments of a launch, in the order of the kernel's parameters (`kernels/*.cu`).
pub fn args_of(k: Kernel, d: &LaunchDims, p: &Ptrs) -> Vec<Arg> {
    use Arg::{Ptr, F32, I32, I64};
    let offsets = [Ptr(p.cu_q), Ptr(p.cu_kv), Ptr(p.off_q), Ptr(p.off_kv)];
    let fallback_tail = |tokens: i64| {
        [
            I32(d.b),
            I32(d.heads),
            I32(d.kv_heads),
            I32(d.dqk),
            I32(d.dv),
            I64(tokens),
            F32(d.scale),
            I32(d.mask),
            I32(d.window.0),
            I32(d.window.1),
            // Bit patterns: the kernels take them as unsigned 64-bit words.
            I64(d.drop.seed as i64),
            I64(d.drop.offset as i64),
            I64(d.drop.keep_at),
            F32(d.drop.rescale),
            Ptr(p.bias),
            I32(d.bias.kind as i32),
            I32(d.bias.dims[0]),
            I32(d.bias.dims[1]),
            I32(d.bias.dims[2]),
            I32(d.bias.dims[3]),
        ]
    };
    let small_tail = [I32(d.b), I32(d.heads), F32(d.scale), I32(d.mask)];
    let mut v = match k {
        Kernel::SmallSeqFwd | Kernel::FallbackFwd | Kernel::TiledFwd => {
            vec![Ptr(p.q), Ptr(p.k), Ptr(p.v), Ptr(p.o), Ptr(p.lse)]
        }
        Kernel::FallbackDelta => vec![Ptr(p.o), Ptr(p.d_o), Ptr(p.delta)],
        Kernel::SmallSeqBwd => vec![
            Ptr(p.q),
            Ptr(p.k),
            Ptr(p.v),
            Ptr(p.d_o),
            Ptr(p.lse),
            Ptr(p.dq),
            Ptr(p.dk),
            Ptr(p.dv),
        ],
        Kernel::FallbackBwdQ
        | Kernel::FallbackBwdKv
        | Kernel::FallbackDbias
        | Kernel::TiledBwdQ
        | Kernel::TiledBwdKv => {
            let inputs = [
                Ptr(p.q),
                Ptr(p.k),
                Ptr(p.v),
                Ptr(p.d_o),
                Ptr(p.lse),
                Ptr(p.delta),
                Ptr(p.rowsum),
            ];
            let outputs: &[Arg] = match k {
                Kernel::FallbackBwdQ | Kernel::TiledBwdQ => &[Ptr(p.dq)],
                Kernel::FallbackDbias => &[Ptr(p.dbias)],
                _ => &[Ptr(p.dk), Ptr(p.dv)],
            };
            [&inputs[..], outputs].concat()
        }
    };
    v.extend(offsets);
    match k {
        Kernel::SmallSeqFwd | Kernel::SmallSeqBwd => v.extend(small_tail),
        Kernel::FallbackFwd | Kernel::FallbackBwdQ => v.extend(fallback_tail(d.tq)),
        Kernel::FallbackBwdKv => v.extend(fallback_tail(d.tk)),
        Kernel::FallbackDbias => v.extend(fallback_tail(d.bias.grad_rows())),
        Kernel::FallbackDelta => v.extend([I32(d.b), I32(d.heads), I32(d.dv), I64(d.tq)]),
        Kernel::TiledFwd | Kernel::TiledBwdQ | Kernel::TiledBwdKv => {
            let tiles = match k {
                Kernel::TiledBwdKv => d.tiled_key_tiles(),
                _ => d.tiled_tiles(),
            };
            v.extend([
                I32(d.b),
                I32(d.heads),
                I32(d.kv_heads),
                I32(tiles),
                F32(d.scale),
                I32(d.mask),
                I32(d.window.0),
                I32(d.window.1),
            ]);
        }
    }
    v
}

/// The tensors a kernel reads and writes 16 bytes per lane at a time (`pt_ld16`, `pt_st16`,
/// `pt_cp_async16` in kernels/portable.h) must start on 16 bytes; rows then stay aligned since
/// every head dim those kernels take is a multiple of 64 elements.
///
/// # Errors
/// The first misaligned tensor.
pub fn check_aligned(kernel: Kernel, p: &Ptrs) -> Result<(), Misaligned> {
    let tensors: &[(&'static str, u64)] = match kernel {
        Kernel::SmallSeqFwd | Kernel::TiledFwd => &[("q", p.q), ("k", p.k), ("v", p.v), ("o", p.o)],
        Kernel::SmallSeqBwd => &[
            ("q", p.q),
            ("k", p.k),
            ("v", p.v),
            ("d_o", p.d_o),
            ("dq", p.dq),
            ("dk", p.dk),
            ("dv", p.dv),
        ],
        Kernel::TiledBwdQ => &[
            ("q", p.q),
            ("k", p.k),
            ("v", p.v),
            ("d_o", p.d_o),
            ("dq", p.dq),
        ],
        Kernel::TiledBwdKv => &[
            ("q", p.q),
            ("k", p.k),
            ("v", p.v),
            ("d_o", p.d_o),
            ("dk", p.dk),
            ("dv", p.dv),
        ],
        Kernel::FallbackFwd
        | Kernel::FallbackBwdQ
        | Kernel::FallbackBwdKv
        | Kernel::FallbackDbias
        | Kernel::FallbackDelta => &[],
    };
    match tensors.iter().find(|(_, a)| a % 16 != 0) {
        Some(&(tensor, addr)) => Err(Misaligned {
            kernel: kernel.name(),
            tensor,
            addr,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::launch::test_dims;
    use smallseq_reference::Dtype;

    #[test]
    fn tiled_backward_launches_pass_their_own_tile_counts() {
        let d = LaunchDims {
            max_lk: 130,
            ..test_dims(Dtype::F16, true, 64, 64, 65)
        };
        // The key side's launch passes its key tiles, the query side the forward's query tiles.
        // The tile count comes before scale, mask and the window's two ends.
        let tiles = |k| {
            let args = args_of(k, &d, &Ptrs::default());
            match args[args.len() - 5] {
                Arg::I32(x) => x,
                _ => panic!("the fifth argument from the end is the tile count"),
            }
        };
        assert_eq!(tiles(Kernel::TiledBwdKv), 3);
        assert_eq!(tiles(Kernel::TiledBwdQ), 2);
    }

    #[test]
    fn vector_kernels_refuse_misaligned_tensors() {
        let p = Ptrs {
            q: 0x1000,
            k: 0x2000,
            v: 0x3000,
            o: 0x4000,
            d_o: 0x5000,
            dq: 0x6000,
            dk: 0x7000,
            dv: 0x8008,
            ..Ptrs::default()
        };
        assert_eq!(check_aligned(Kernel::SmallSeqFwd, &p), Ok(()));
        let e = check_aligned(Kernel::SmallSeqBwd, &p).unwrap_err();
        assert_eq!((e.tensor, e.addr), ("dv", 0x8008));
        assert!(e.to_string().contains("tensor dv at 0x8008"), "{e}");
        assert!(e.to_string().starts_with("SmallSeqBwd: "), "{e}");
        for k in [
            Kernel::SmallSeqFwd,
            Kernel::SmallSeqBwd,
            Kernel::FallbackFwd,
            Kernel::TiledFwd,
            Kernel::FallbackBwdQ,
            Kernel::FallbackBwdKv,
            Kernel::TiledBwdQ,
            Kernel::TiledBwdKv,
        ] {
            assert_eq!(
                k.name(),
                format!("{k:?}"),
                "errors print the kind as before"
            );
        }
        let q_off = Ptrs { q: 0x1002, ..p };
        assert!(check_aligned(Kernel::TiledFwd, &q_off).is_err());
        assert_eq!(check_aligned(Kernel::FallbackFwd, &q_off), Ok(()));
    }
}
