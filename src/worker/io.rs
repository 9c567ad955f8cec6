//! The tensor files of the protocol: outputs written by a worker, read back by the campaign.

use crate::case::{Case, Outputs};
use crate::case_file::parse_outputs;
use crate::error::{Error, Result};
use ndarray::ArrayViewD;
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;

/// Writes f32 tensors (bit for bit: NaN payloads and guards survive) to `path` atomically:
/// a temporary name, then a rename, so a reader never sees half a file.
///
/// # Errors
/// [`Error::Io`] naming the path.
pub fn write_outputs(path: &Path, tensors: &[(&str, ArrayViewD<'_, f32>)]) -> Result<()> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| {
            let mut data = Vec::with_capacity(t.len() * 4);
            match t.as_slice() {
                Some(s) => s
                    .iter()
                    .for_each(|x| data.extend_from_slice(&x.to_le_bytes())),
                None => t
                    .iter()
                    .for_each(|x| data.extend_from_slice(&x.to_le_bytes())),
            }
            (name.to_string(), t.shape().to_vec(), data)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Tensor {
                    tensor: n.clone(),
                    detail: format!("cannot encode: {e}"),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let blob = safetensors::serialize(views, &None).map_err(|e| Error::Tensor {
        tensor: "<outputs>".into(),
        detail: format!("cannot serialise: {e}"),
    })?;
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, blob).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Reads an output file, shapes checked against `case`.
///
/// # Errors
/// [`Error::Io`], or [`Error::CaseFile`] naming the tensor.
pub fn read_outputs_file(path: &Path, case: &Case) -> Result<Outputs> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_outputs(&bytes, &path.display().to_string(), case)
}
