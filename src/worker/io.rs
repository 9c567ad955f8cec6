//! The tensor files of the protocol: outputs written by a worker, read back by the campaign.

use crate::case::Case;
use crate::case_file::{parse_outputs_f32, Outputs32};
use crate::error::{Error, Result};
use ndarray::ArrayViewD;
use safetensors::tensor::{Dtype, TensorView};
use std::borrow::Cow;
use std::path::Path;

/// The little-endian bytes of `t`: borrowed where its memory already is that (a contiguous
/// array on a little-endian machine), which spares a copy of every output a worker writes.
fn le_bytes<'a>(t: &'a ArrayViewD<'_, f32>) -> Cow<'a, [u8]> {
    #[cfg(target_endian = "little")]
    if let Some(s) = t.as_slice() {
        // SAFETY: any initialised memory is valid as u8, u8 needs no alignment, and the
        // length covers exactly the slice's bytes, borrowed for as long as the slice.
        return Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s))
        });
    }
    let mut data = Vec::with_capacity(t.len() * 4);
    t.iter()
        .for_each(|x| data.extend_from_slice(&x.to_le_bytes()));
    Cow::Owned(data)
}

/// Writes f32 tensors (bit for bit: NaN payloads and guards survive) to `path` atomically:
/// a temporary name, then a rename, so a reader never sees half a file.
///
/// # Errors
/// [`Error::Io`] naming the path.
pub fn write_outputs(path: &Path, tensors: &[(&str, ArrayViewD<'_, f32>)]) -> Result<()> {
    let bytes: Vec<_> = tensors
        .iter()
        .map(|(name, t)| (*name, t.shape().to_vec(), le_bytes(t)))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (n.to_string(), v))
                .map_err(|e| Error::Tensor {
                    tensor: n.to_string(),
                    detail: format!("cannot encode: {}", crate::case_file::safetensors_text(&e)),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let blob = safetensors::serialize(views, &None).map_err(|e| Error::Tensor {
        tensor: "<outputs>".into(),
        detail: format!(
            "cannot serialise: {}",
            crate::case_file::safetensors_text(&e)
        ),
    })?;
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, blob).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Reads an output file as f32, shapes checked against `case`.
///
/// # Errors
/// [`Error::Io`], or [`Error::CaseFile`] naming the tensor.
pub fn read_outputs_file(path: &Path, case: &Case) -> Result<Outputs32> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_outputs_f32(&bytes, &path.display().to_string(), case)
}
