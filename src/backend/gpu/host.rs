//! Host-side views of what a GPU backend uploads: tensors in the storage type of their dtype,
//! and the bytes of plain element slices.

use ndarray::ArrayView3;
use smallseq_reference::Dtype;

/// Elements of a tensor in row-major order, in the storage type of `dtype`.
pub(crate) enum HostTensor {
    U16(Vec<u16>),
    F32(Vec<f32>),
}

impl HostTensor {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            HostTensor::U16(v) => bytes_of(v),
            HostTensor::F32(v) => bytes_of(v),
        }
    }
}

/// The tensor in the storage type of `dtype`. A whole slice at a time: `half` converts a
/// slice with the same instruction (F16C) or function as one value, without a call per element.
pub(crate) fn to_host(dtype: Dtype, a: &ArrayView3<f32>) -> HostTensor {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let owned: Vec<f32>;
    let src = match a.as_slice() {
        Some(s) => s,
        None => {
            owned = a.iter().copied().collect();
            &owned
        }
    };
    let mut bits = vec![0u16; src.len()];
    match dtype {
        Dtype::Bf16 => bits
            .reinterpret_cast_mut::<half::bf16>()
            .convert_from_f32_slice(src),
        Dtype::F16 => bits
            .reinterpret_cast_mut::<half::f16>()
            .convert_from_f32_slice(src),
        Dtype::F32 => return HostTensor::F32(src.to_vec()),
    }
    HostTensor::U16(bits)
}

/// Element types whose every bit pattern is a value and that hold no padding: their slices
/// may be viewed as bytes, and bytes written into them.
pub(crate) trait Plain: Copy {}
impl Plain for u16 {}
impl Plain for i32 {}
impl Plain for f32 {}

/// The bytes of a slice of plain elements.
pub(crate) fn bytes_of<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is plain (no padding, see `Plain`), the view covers exactly the slice's
    // bytes and borrows it, and `u8` has no alignment requirement.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// The bytes of a slice of plain elements, to be written.
pub(crate) fn bytes_of_mut<T: Plain>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; and every bit pattern is a `T`, so any bytes written are valid.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slice conversion stores what a conversion per element stores: ties, subnormals,
    /// overflow, signed zeros, NaN payloads; contiguous or not.
    #[test]
    fn host_tensors_convert_like_one_value_at_a_time() {
        let mut vals: Vec<f32> = (0..4099u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B9)))
            .collect();
        vals.extend([
            0.0,
            -0.0,
            1.0 + f32::EPSILON,
            65520.0,
            1e-7,
            f32::from_bits(0x7fa0_0001),
            f32::from_bits(0xffc0_1234),
            f32::INFINITY,
        ]);
        let n = vals.len();
        let a = ndarray::Array3::from_shape_vec((n, 1, 1), vals.clone()).unwrap();
        let strided =
            ndarray::Array3::from_shape_vec((n, 2, 1), [vals.clone(), vals].concat()).unwrap();
        for view in [a.view(), strided.slice(ndarray::s![.., 0..1, ..])] {
            let want16: Vec<u16> = view
                .iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect();
            let wantb: Vec<u16> = view
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect();
            match (to_host(Dtype::F16, &view), to_host(Dtype::Bf16, &view)) {
                (HostTensor::U16(f), HostTensor::U16(b)) => {
                    assert_eq!(f, want16);
                    assert_eq!(b, wantb);
                }
                _ => panic!("16-bit dtypes are stored as u16"),
            }
            match to_host(Dtype::F32, &view) {
                HostTensor::F32(v) => assert!(v
                    .iter()
                    .zip(view.iter())
                    .all(|(a, b)| { a.to_bits() == b.to_bits() })),
                HostTensor::U16(_) => panic!("f32 is stored as f32"),
            }
        }
    }

    #[test]
    fn byte_views_are_the_elements_native_bytes() {
        let v = [1.5f32, -0.0];
        let b = bytes_of(&v);
        assert_eq!(b.len(), 8);
        assert_eq!(&b[..4], &1.5f32.to_ne_bytes());
        let mut w = [0f32; 2];
        bytes_of_mut(&mut w).copy_from_slice(b);
        assert_eq!(w[0], 1.5);
        assert!(w[1].is_sign_negative());
        assert_eq!(bytes_of(&[7i32]), &7i32.to_ne_bytes());
    }
}
