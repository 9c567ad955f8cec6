//! Case files (capsules), `docs/semantics.md` §2: one safetensors file per case.

use crate::case::{bshd_seq_lens, Case, Outputs};
use crate::config::{AttnConfig, Bias, LayoutKind};
use crate::error::{Error, Result};
use half::{bf16, f16};
use ndarray::{Array3, ArrayD, IxDyn};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use smallseq_reference::{AttnBias, Dtype, Layout, Side};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

/// Format version written to `smallseq.format`.
pub const FORMAT: &str = "1";

/// How output tensors are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputPrecision {
    /// The golden reference: every output as F64.
    Reference,
    /// A device backend: `o`, `dq`, `dk`, `dv` in the input dtype, `lse` as F32.
    Device,
}

fn file_err(path: &str, detail: impl Into<String>) -> Error {
    Error::CaseFile {
        path: path.into(),
        detail: detail.into(),
    }
}

/// A safetensors error as a sentence: the crate's `Display` prints its variant names
/// (`HeaderTooSmall`), which tell a user nothing about their file.
pub fn safetensors_text(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::InvalidHeader => "its header is not valid UTF-8 text".into(),
        E::InvalidHeaderStart => "its header does not start with '{' (a JSON object)".into(),
        E::InvalidHeaderDeserialization => "its header is text but not valid JSON".into(),
        E::HeaderTooLarge => {
            "the header length in its first 8 bytes is larger than the file or than 100 MB \
             (is it a safetensors file at all?)"
                .into()
        }
        E::HeaderTooSmall => {
            "it is shorter than the 8-byte header length a safetensors file starts with \
             (empty or truncated?)"
                .into()
        }
        E::InvalidHeaderLength => "the header length in its first 8 bytes is invalid".into(),
        E::TensorNotFound(t) => format!("it holds no tensor named '{t}'"),
        E::TensorInvalidInfo => {
            "a tensor's shape and dtype do not match its byte range in the header".into()
        }
        E::InvalidOffset(t) => format!("the byte offsets of tensor '{t}' are invalid"),
        E::IoError(io) => format!("it cannot be read: {io}"),
        E::JsonError(j) => format!("its header is not valid JSON: {j}"),
        E::InvalidTensorView(dt, shape, len) => {
            let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
            format!(
                "a tensor of dtype {} and shape [{}] does not fit its {len} bytes",
                dtype_name(*dt),
                dims.join(", ")
            )
        }
        E::MetadataIncompleteBuffer => {
            "the tensors in its header do not cover the data that follows it (truncated or \
             padded file?)"
                .into()
        }
        E::ValidationOverflow => "a tensor's shape in its header overflows when multiplied".into(),
    }
}

fn not_safetensors(name: &str, e: &safetensors::SafeTensorError) -> Error {
    file_err(
        name,
        format!("not a valid safetensors file: {}", safetensors_text(e)),
    )
}

/// Reads a case file.
///
/// # Errors
/// [`Error::CaseFile`] (or a layout/config error) with one line naming the tensor or field,
/// the index and the value.
pub fn read_case(path: &Path) -> Result<Case> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_case(&bytes, &path.display().to_string())
}

/// Parses a case from safetensors bytes; `name` is used in errors.
///
/// # Errors
/// As [`read_case`].
pub fn parse_case(bytes: &[u8], name: &str) -> Result<Case> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| not_safetensors(name, &e))?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| not_safetensors(name, &e))?;
    let meta: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    match meta.get("smallseq.format").map(String::as_str) {
        Some(FORMAT) => {}
        Some(other) => {
            return Err(file_err(
                name,
                format!("smallseq.format = '{other}': this build reads format '{FORMAT}'"),
            ))
        }
        None => return Err(file_err(name, "metadata smallseq.format is missing")),
    }
    let config_text = meta
        .get("smallseq.config")
        .ok_or_else(|| file_err(name, "metadata smallseq.config is missing"))?;
    let config = AttnConfig::from_json(config_text)?;
    for t in st.names() {
        if !KNOWN.contains(&t.as_str()) {
            return Err(file_err(name, format!("unknown tensor '{t}'")));
        }
    }
    let reader = Reader { st: &st, name };
    let mut config = config;
    config.params.bias = reader.bias(&config)?;
    let p = &config.params;
    let q = reader.input("q", config.dtype, config.layout)?;
    let k = reader.input("k", config.dtype, config.layout)?;
    let v = reader.input("v", config.dtype, config.layout)?;
    let d_o = match reader.st.tensor("d_o") {
        Ok(_) => Some(reader.input("d_o", config.dtype, config.layout)?),
        Err(_) => None,
    };
    let (tq, tk) = (q.shape()[0], k.shape()[0]);
    for (t, arr, h, d) in [
        ("q", &q, p.num_heads, p.head_dim_qk),
        ("k", &k, p.num_kv_heads, p.head_dim_qk),
        ("v", &v, p.num_kv_heads, p.head_dim_v),
    ] {
        let want = [arr.shape()[0], h, d];
        if arr.shape()[1..] != want[1..] {
            return Err(file_err(
                name,
                format!(
                    "tensor {t}: shape {}, expected [T, {h}, {d}] from smallseq.config",
                    shape_text(arr.shape())
                ),
            ));
        }
    }
    let side = |cu: &str, padded: &str, tokens| -> Result<Side> {
        Ok(Side {
            cu: reader.offsets(cu)?,
            padded: match reader.st.tensor(padded) {
                Ok(_) => Some(reader.offsets(padded)?),
                Err(_) => None,
            },
            tokens,
        })
    };
    let layout = Layout::new(
        side("cu_seqlens_q", "cu_seqlens_q_padded", tq)?,
        side("cu_seqlens_kv", "cu_seqlens_kv_padded", tk)?,
    )?;
    if config.layout == LayoutKind::Bshd {
        bshd_seq_lens(&layout)?;
    }
    let mut case = Case {
        config,
        layout,
        q,
        k,
        v,
        d_o,
        outputs: Outputs::default(),
        meta: BTreeMap::new(),
    };
    // The inputs were decoded from the config's dtype (checked above), so every element is a
    // value of it: only the structure is left to check.
    case.validate_structure()?;
    case.outputs = reader.outputs(&case)?;
    case.meta = meta;
    Ok(case)
}

const KNOWN: [&str; 16] = [
    "q",
    "k",
    "v",
    "d_o",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "o",
    "lse",
    "dq",
    "dk",
    "dv",
    "bias",
    "alibi_slopes",
    "dbias",
];

struct Reader<'a> {
    st: &'a SafeTensors<'a>,
    name: &'a str,
}

impl Reader<'_> {
    fn get(&self, t: &str) -> Result<TensorView<'_>> {
        self.st
            .tensor(t)
            .map_err(|_| file_err(self.name, format!("tensor '{t}' is missing")))
    }

    fn floats(&self, t: &str, view: &TensorView<'_>) -> Result<Vec<f64>> {
        let data = view.data();
        Ok(match view.dtype() {
            StDtype::BF16 => data
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
            StDtype::F16 => data
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect(),
            StDtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).into())
                .collect(),
            StDtype::F64 => data
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("chunk of 8")))
                .collect(),
            other => {
                return Err(file_err(
                    self.name,
                    format!(
                        "tensor {t}: dtype {} is not a float type",
                        dtype_name(other)
                    ),
                ))
            }
        })
    }

    /// As [`Reader::floats`], to f32: what `x as f32` of the f64 would give (exact for the
    /// 16-bit and f32 dtypes), without the f64 in between.
    fn floats32(&self, t: &str, view: &TensorView<'_>) -> Result<Vec<f32>> {
        let data = view.data();
        Ok(match view.dtype() {
            StDtype::BF16 => data
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::F16 => data
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::F64 => data
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("chunk of 8")) as f32)
                .collect(),
            other => {
                return Err(file_err(
                    self.name,
                    format!(
                        "tensor {t}: dtype {} is not a float type",
                        dtype_name(other)
                    ),
                ))
            }
        })
    }

    /// An output tensor as f32, shape checked.
    fn output32(&self, t: &str, expected: &[usize]) -> Result<Option<ArrayD<f32>>> {
        self.output_as(t, expected, Self::floats32)
    }

    /// An output tensor, shape checked, decoded by `decode`; `None` when the file lacks it.
    fn output_as<T>(
        &self,
        t: &str,
        expected: &[usize],
        decode: impl Fn(&Self, &str, &TensorView<'_>) -> Result<Vec<T>>,
    ) -> Result<Option<ArrayD<T>>> {
        let Ok(view) = self.st.tensor(t) else {
            return Ok(None);
        };
        if view.shape() != expected {
            return Err(file_err(
                self.name,
                format!(
                    "tensor {t}: shape {}, expected {}",
                    shape_text(view.shape()),
                    shape_text(expected)
                ),
            ));
        }
        let vals = decode(self, t, &view)?;
        Ok(Some(
            ArrayD::from_shape_vec(IxDyn(expected), vals)
                .map_err(|e| file_err(self.name, format!("tensor {t}: {e}")))?,
        ))
    }

    /// An input tensor: dtype must equal the config's, rank 3 (or rank 4 `[B,S,H,D]` for BSHD).
    fn input(&self, t: &str, dtype: Dtype, layout: LayoutKind) -> Result<Array3<f32>> {
        let view = self.get(t)?;
        let want = st_dtype(dtype);
        if view.dtype() != want {
            return Err(file_err(
                self.name,
                format!(
                    "tensor {t}: dtype {}, expected {} (config dtype {dtype})",
                    dtype_name(view.dtype()),
                    dtype_name(want)
                ),
            ));
        }
        let shape = view.shape().to_vec();
        let shape3 = match (shape.len(), layout) {
            (3, _) => [shape[0], shape[1], shape[2]],
            (4, LayoutKind::Bshd) => [shape[0] * shape[1], shape[2], shape[3]],
            _ => {
                return Err(file_err(
                    self.name,
                    format!(
                        "tensor {t}: shape {} has rank {}, expected [T, H, D]",
                        shape_text(&shape),
                        shape.len()
                    ),
                ))
            }
        };
        // Inputs have the config's dtype (checked above): decoded straight to f32.
        let vals = self.floats32(t, &view)?;
        Array3::from_shape_vec(shape3, vals)
            .map_err(|e| file_err(self.name, format!("tensor {t}: {e}")))
    }

    fn offsets(&self, t: &str) -> Result<Vec<i32>> {
        let view = self.get(t)?;
        if view.dtype() != StDtype::I32 {
            return Err(file_err(
                self.name,
                format!(
                    "tensor {t}: dtype {}, expected i32",
                    dtype_name(view.dtype())
                ),
            ));
        }
        if view.shape().len() != 1 {
            return Err(file_err(
                self.name,
                format!(
                    "tensor {t}: shape {}, expected [b+1]",
                    shape_text(view.shape())
                ),
            ));
        }
        Ok(view
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// The bias values the config names (`docs/semantics.md` §2.1): `bias` `[Bb, Hb, Sq, Sk]`
    /// in the input dtype for a post-scale bias, `alibi_slopes` `[H]` f32 for ALiBi.
    fn bias(&self, config: &AttnConfig) -> Result<AttnBias> {
        let present = |t: &str| self.st.tensor(t).is_ok();
        let (want, dtype, rank) = match config.bias {
            Bias::PostScale(_) => ("bias", st_dtype(config.dtype), 4),
            Bias::Alibi => ("alibi_slopes", StDtype::F32, 1),
            _ => {
                if let Some(t) = ["bias", "alibi_slopes"].into_iter().find(|t| present(t)) {
                    return Err(file_err(
                        self.name,
                        format!(
                            "tensor {t}: present, but smallseq.config has bias = {}",
                            config.bias
                        ),
                    ));
                }
                return Ok(AttnBias::None);
            }
        };
        if let Some(t) = ["bias", "alibi_slopes"]
            .into_iter()
            .find(|t| *t != want && present(t))
        {
            return Err(file_err(
                self.name,
                format!(
                    "tensor {t}: present, but smallseq.config has bias = {}",
                    config.bias
                ),
            ));
        }
        let view = self.get(want)?;
        if view.dtype() != dtype {
            return Err(file_err(
                self.name,
                format!(
                    "tensor {want}: dtype {}, expected {}",
                    dtype_name(view.dtype()),
                    dtype_name(dtype)
                ),
            ));
        }
        let shape = view.shape().to_vec();
        if shape.len() != rank {
            let expected = if rank == 4 { "[Bb, Hb, Sq, Sk]" } else { "[H]" };
            return Err(file_err(
                self.name,
                format!(
                    "tensor {want}: shape {}, expected {expected}",
                    shape_text(&shape)
                ),
            ));
        }
        let vals = self.floats32(want, &view)?;
        Ok(if rank == 4 {
            let t = ndarray::Array4::from_shape_vec([shape[0], shape[1], shape[2], shape[3]], vals)
                .map_err(|e| file_err(self.name, format!("tensor {want}: {e}")))?;
            AttnBias::PostScale(Arc::new(t))
        } else {
            AttnBias::Alibi(Arc::new(vals))
        })
    }

    fn output(&self, t: &str, expected: &[usize]) -> Result<Option<ArrayD<f64>>> {
        self.output_as(t, expected, Self::floats)
    }

    fn outputs(&self, case: &Case) -> Result<Outputs> {
        let p = &case.config.params;
        let (tq, tk) = (case.layout.q.tokens, case.layout.kv.tokens);
        let dim3 = |a: Option<ArrayD<f64>>| -> Option<Array3<f64>> {
            a.map(|a| a.into_dimensionality().expect("shape checked"))
        };
        Ok(Outputs {
            o: dim3(self.output("o", &[tq, p.num_heads, p.head_dim_v])?),
            lse: self.output("lse", &[tq, p.num_heads])?.map(|a| {
                a.into_dimensionality::<ndarray::Ix2>()
                    .expect("shape checked")
            }),
            dq: dim3(self.output("dq", &[tq, p.num_heads, p.head_dim_qk])?),
            dk: dim3(self.output("dk", &[tk, p.num_kv_heads, p.head_dim_qk])?),
            dv: dim3(self.output("dv", &[tk, p.num_kv_heads, p.head_dim_v])?),
            dbias: match p.bias.grad_shape() {
                Some(shape) => self
                    .output("dbias", &shape)?
                    .map(|a| a.into_dimensionality().expect("shape checked")),
                None => self.refuse("dbias", "the case has no post-scale bias")?,
            },
        })
    }

    /// An error if tensor `t` is present: `why` it cannot be.
    fn refuse<T>(&self, t: &str, why: &str) -> Result<Option<T>> {
        match self.st.tensor(t) {
            Ok(_) => Err(file_err(
                self.name,
                format!("tensor {t}: present, but {why}"),
            )),
            Err(_) => Ok(None),
        }
    }
}

fn st_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::Bf16 => StDtype::BF16,
        Dtype::F16 => StDtype::F16,
        Dtype::F32 => StDtype::F32,
    }
}

fn encode(dtype: StDtype, vals: impl Iterator<Item = f64>) -> Vec<u8> {
    let mut out = Vec::new();
    for x in vals {
        match dtype {
            StDtype::BF16 => out.extend(bf16::from_f64(x).to_le_bytes()),
            StDtype::F16 => out.extend(f16::from_f64(x).to_le_bytes()),
            StDtype::F32 => out.extend((x as f32).to_le_bytes()),
            _ => out.extend(x.to_le_bytes()),
        }
    }
    out
}

/// Reads the output tensors (`o`, `lse`, `dq`, `dk`, `dv`, any float dtype) of a file that
/// holds only outputs, such as a worker's reply file, with shapes checked against `case`.
///
/// # Errors
/// [`Error::CaseFile`] naming the tensor: not safetensors, a shape or dtype that does not fit,
/// an unknown tensor.
pub fn parse_outputs(bytes: &[u8], name: &str, case: &Case) -> Result<Outputs> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| not_safetensors(name, &e))?;
    for t in st.names() {
        if !["o", "lse", "dq", "dk", "dv", "dbias"].contains(&t.as_str()) {
            return Err(file_err(name, format!("unknown output tensor '{t}'")));
        }
    }
    Reader { st: &st, name }.outputs(case)
}

/// A worker's outputs as f32, the precision the properties judge a run's outputs in.
#[derive(Clone, Debug, Default)]
pub struct Outputs32 {
    pub o: Option<Array3<f32>>,
    pub lse: Option<ndarray::Array2<f32>>,
    pub dq: Option<Array3<f32>>,
    pub dk: Option<Array3<f32>>,
    pub dv: Option<Array3<f32>>,
    /// dBias `[Bb, Hb, Sq, Sk]`, where the reply carries one (an in-tree worker's).
    pub dbias: Option<ndarray::Array4<f32>>,
}

/// As [`parse_outputs`], to f32 (each element as `x as f32` of what [`parse_outputs`]
/// reads): a worker's reply file read without an f64 copy of every tensor.
///
/// # Errors
/// As [`parse_outputs`].
pub fn parse_outputs_f32(bytes: &[u8], name: &str, case: &Case) -> Result<Outputs32> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| not_safetensors(name, &e))?;
    for t in st.names() {
        if !["o", "lse", "dq", "dk", "dv", "dbias"].contains(&t.as_str()) {
            return Err(file_err(name, format!("unknown output tensor '{t}'")));
        }
    }
    let r = Reader { st: &st, name };
    let p = &case.config.params;
    let (tq, tk) = (case.layout.q.tokens, case.layout.kv.tokens);
    let dim3 = |a: Option<ArrayD<f32>>| -> Option<Array3<f32>> {
        a.map(|a| a.into_dimensionality().expect("shape checked"))
    };
    Ok(Outputs32 {
        o: dim3(r.output32("o", &[tq, p.num_heads, p.head_dim_v])?),
        lse: r.output32("lse", &[tq, p.num_heads])?.map(|a| {
            a.into_dimensionality::<ndarray::Ix2>()
                .expect("shape checked")
        }),
        dq: dim3(r.output32("dq", &[tq, p.num_heads, p.head_dim_qk])?),
        dk: dim3(r.output32("dk", &[tk, p.num_kv_heads, p.head_dim_qk])?),
        dv: dim3(r.output32("dv", &[tk, p.num_kv_heads, p.head_dim_v])?),
        dbias: match p.bias.grad_shape() {
            Some(shape) => r
                .output32("dbias", &shape)?
                .map(|a| a.into_dimensionality().expect("shape checked")),
            None => r.refuse("dbias", "the case has no post-scale bias")?,
        },
    })
}

fn encode_f32(dtype: StDtype, t: &ndarray::Array3<f32>) -> Vec<u8> {
    let width = if dtype == StDtype::F32 { 4 } else { 2 };
    let mut out = Vec::with_capacity(t.len() * width);
    let mut put = |x: f32| match dtype {
        StDtype::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
        StDtype::F16 => out.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
        _ => out.extend_from_slice(&x.to_le_bytes()),
    };
    match t.as_slice() {
        Some(s) => s.iter().for_each(|&x| put(x)),
        None => t.iter().for_each(|&x| put(x)),
    }
    out
}

/// Serialises a case (inputs, stored outputs, metadata) to safetensors bytes.
///
/// # Errors
/// [`Error::CaseFile`] if serialisation fails.
pub fn case_bytes(case: &Case, precision: OutputPrecision) -> Result<Vec<u8>> {
    encode_case(case, Some(precision), &case.meta)
}

/// A case's inputs alone (no stored outputs, no metadata beyond the format, the config and
/// the segment ids the launch converts): what a worker request names, written without
/// copying the case.
///
/// # Errors
/// As [`case_bytes`].
pub fn input_bytes(case: &Case) -> Result<Vec<u8>> {
    let inputs: BTreeMap<String, String> = case
        .meta
        .get_key_value(crate::segments::META_KEY)
        .map(|(k, v)| (k.clone(), v.clone()))
        .into_iter()
        .collect();
    encode_case(case, None, &inputs)
}

/// `precision`: how stored outputs are written; `None` leaves them out.
fn encode_case(
    case: &Case,
    precision: Option<OutputPrecision>,
    meta: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let in_dt = st_dtype(case.config.dtype);
    let mut tensors: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in case.inputs() {
        // Inputs hold values of the input dtype: converted from f32 directly (exact), not
        // through f64; this is most of a worker request's cost.
        tensors.push((name.into(), in_dt, t.shape().to_vec(), encode_f32(in_dt, t)));
    }
    match &case.config.params.bias {
        AttnBias::PostScale(t) => {
            let t3 = t
                .view()
                .into_shape_with_order((t.dim().0 * t.dim().1, t.dim().2, t.dim().3))
                .map_err(|e| file_err("bias", format!("cannot encode: {e}")))?
                .to_owned();
            tensors.push((
                "bias".into(),
                in_dt,
                t.shape().to_vec(),
                encode_f32(in_dt, &t3),
            ));
        }
        AttnBias::Alibi(s) => {
            let bytes = s.iter().flat_map(|x| x.to_le_bytes()).collect();
            tensors.push(("alibi_slopes".into(), StDtype::F32, vec![s.len()], bytes));
        }
        AttnBias::None => {}
    }
    let mut push_f = |name: &str, dt: StDtype, shape: &[usize], vals: Vec<f64>| {
        tensors.push((
            name.into(),
            dt,
            shape.to_vec(),
            encode(dt, vals.into_iter()),
        ));
    };
    let (out_dt, lse_dt) = match precision {
        Some(OutputPrecision::Reference) => (StDtype::F64, StDtype::F64),
        Some(OutputPrecision::Device) => (in_dt, StDtype::F32),
        None => (in_dt, StDtype::F32),
    };
    let none = Outputs::default();
    let o = if precision.is_some() {
        &case.outputs
    } else {
        &none
    };
    for (name, t) in [("o", &o.o), ("dq", &o.dq), ("dk", &o.dk), ("dv", &o.dv)] {
        if let Some(t) = t {
            push_f(name, out_dt, t.shape(), t.iter().copied().collect());
        }
    }
    if let Some(l) = &o.lse {
        push_f("lse", lse_dt, l.shape(), l.iter().copied().collect());
    }
    if let Some(d) = &o.dbias {
        push_f("dbias", out_dt, d.shape(), d.iter().copied().collect());
    }
    let mut ints = |name: &str, a: &[i32]| {
        let bytes = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push((name.into(), StDtype::I32, vec![a.len()], bytes));
    };
    ints("cu_seqlens_q", &case.layout.q.cu);
    ints("cu_seqlens_kv", &case.layout.kv.cu);
    if let Some(p) = &case.layout.q.padded {
        ints("cu_seqlens_q_padded", p);
    }
    if let Some(p) = &case.layout.kv.padded {
        ints("cu_seqlens_kv_padded", p);
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dt, shape, bytes)| {
            TensorView::new(*dt, shape.clone(), bytes)
                .map(|v| (n.clone(), v))
                .map_err(|e| file_err(n, format!("cannot encode: {}", safetensors_text(&e))))
        })
        .collect::<Result<_>>()?;
    let mut meta: HashMap<String, String> = meta.clone().into_iter().collect();
    meta.insert("smallseq.format".into(), FORMAT.into());
    meta.insert("smallseq.config".into(), case.config.to_json());
    meta.entry("smallseq.version".into())
        .or_insert_with(|| env!("CARGO_PKG_VERSION").into());
    safetensors::serialize(views, &Some(meta)).map_err(|e| {
        file_err(
            "<memory>",
            format!("cannot serialise: {}", safetensors_text(&e)),
        )
    })
}

/// Writes a case atomically: a temporary file in the same directory, then a rename, so a
/// reader never sees half a capsule.
///
/// # Errors
/// [`Error::Io`] or a serialisation error.
pub fn write_case(case: &Case, path: &Path, precision: OutputPrecision) -> Result<()> {
    let bytes = case_bytes(case, precision)?;
    crate::files::write_atomic(path, &bytes)
}

/// A tensor's shape as the error texts show it: `[3, 4, 5]`.
fn shape_text(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// A safetensors dtype by the name the format's header spells it with, in lower case
/// (`f32`, `bf16`, `i32`, …), never as a Rust value.
fn dtype_name(dt: StDtype) -> String {
    serde_json::to_value(dt)
        .ok()
        .and_then(|v| v.as_str().map(str::to_lowercase))
        .unwrap_or_else(|| "an unknown type".into())
}

#[cfg(test)]
mod text_tests {
    use super::*;

    #[test]
    fn dtypes_and_shapes_read_as_the_format_spells_them() {
        assert_eq!(dtype_name(StDtype::F32), "f32");
        assert_eq!(dtype_name(StDtype::BF16), "bf16");
        assert_eq!(dtype_name(StDtype::I32), "i32");
        assert_eq!(shape_text(&[3, 4, 5]), "[3, 4, 5]");
        assert_eq!(shape_text(&[]), "[]");
    }
}
