//! `AttnConfig`: the static description of an attention call (`docs/semantics.md` §2.2).

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use smallseq_reference::{AttnBias, AttnParams, Dropout, Dtype, Mask, Window};
use std::fmt;

/// Tensor layout family of the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayoutKind {
    /// Packed tokens with `cu_seqlens` (and optional padded offsets).
    Thd,
    /// Dense `[B, S, H, D]`; every slot holds exactly `S` tokens.
    Bshd,
}

impl LayoutKind {
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Thd => "thd",
            LayoutKind::Bshd => "bshd",
        }
    }
}

/// Bias type (`docs/semantics.md` §1.9). The values of a post-scale bias or ALiBi's slopes
/// travel as tensors of the case (`params.bias`); the config names the type and the shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Bias {
    None,
    /// TE's `post_scale_bias`: `S = scale·QKᵀ + bias`, of the broadcast shape given.
    PostScale(BiasShape),
    /// ALiBi: `−slope_h · |r + (Lk − Lq) − c|`.
    Alibi,
    /// Any other name (TE's `pre_scale_bias`, …): decided by the dispatch surfaces, never run.
    Other(String),
}

impl Bias {
    /// Whether §1.9 defines the bias (none, a post-scale tensor, ALiBi).
    pub fn is_modelled(&self) -> bool {
        !matches!(self, Bias::Other(_))
    }
}

/// Which dimensions of a post-scale bias `[1|b, 1|H, Sq, Sk]` broadcast (TE's
/// `NVTE_Bias_Shape`: `1HSS`, `11SS`, `B1SS`, `BHSS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BiasShape {
    OneHss,
    OneOneSs,
    BOneSs,
    Bhss,
}

impl BiasShape {
    pub const ALL: [BiasShape; 4] = [
        BiasShape::OneHss,
        BiasShape::OneOneSs,
        BiasShape::BOneSs,
        BiasShape::Bhss,
    ];

    /// The config's name (key `bias_shape`).
    pub fn name(self) -> &'static str {
        match self {
            BiasShape::OneHss => "1hss",
            BiasShape::OneOneSs => "11ss",
            BiasShape::BOneSs => "b1ss",
            BiasShape::Bhss => "bhss",
        }
    }

    /// Whether the bias has one plane per slot (`b`) and per head (`H`).
    pub fn per_slot(self) -> bool {
        matches!(self, BiasShape::BOneSs | BiasShape::Bhss)
    }

    pub fn per_head(self) -> bool {
        matches!(self, BiasShape::OneHss | BiasShape::Bhss)
    }
}

impl fmt::Display for Bias {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bias::None => f.write_str("none"),
            Bias::PostScale(_) => f.write_str("post_scale_bias"),
            Bias::Alibi => f.write_str("alibi"),
            Bias::Other(s) => f.write_str(s),
        }
    }
}

/// The static configuration of one attention call.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnConfig {
    pub dtype: Dtype,
    /// Heads (`num_heads`, `num_gqa_groups` = kv heads), head dims, mask, window and scale.
    pub params: AttnParams,
    pub bias: Bias,
    pub layout: LayoutKind,
}

const KEYS: [&str; 14] = [
    "dtype",
    "num_heads",
    "num_gqa_groups",
    "head_dim_qk",
    "head_dim_v",
    "mask",
    "window",
    "bias",
    "bias_shape",
    "dropout",
    "dropout_seed",
    "dropout_offset",
    "scale",
    "layout",
];

impl AttnConfig {
    /// A plain MHA config with the default scale `1/sqrt(d)`.
    pub fn new(dtype: Dtype, heads: usize, head_dim: usize, mask: Mask) -> Self {
        AttnConfig {
            dtype,
            params: AttnParams {
                num_heads: heads,
                num_kv_heads: heads,
                head_dim_qk: head_dim,
                head_dim_v: head_dim,
                mask,
                window: Window::NONE,
                scale: 1.0 / (head_dim as f64).sqrt(),
                dropout: Dropout::NONE,
                bias: AttnBias::None,
            },
            bias: Bias::None,
            layout: LayoutKind::Thd,
        }
    }

    /// The dropout probability `p` (0: none).
    pub fn dropout_p(&self) -> f64 {
        self.params.dropout.p
    }

    /// Why an implementation cannot run the case: outside `docs/semantics.md` §1 (§1.9: a
    /// bias type it does not define), or a dropout (§1.8) or bias (§1.9) the implementation
    /// says it does not compute (`computes`: dropout, bias; the CUDA and HIP kernels, and
    /// workers that do not declare `caps.dropout` or `caps.bias`).
    pub fn unsupported_reason(&self, computes: (bool, bool)) -> Option<String> {
        let (computes_dropout, computes_bias) = computes;
        if self.params.dropout.is_active() && !computes_dropout {
            return Some(format!(
                "dropout = {}: this implementation does not compute dropout (docs/semantics.md §1.8)",
                self.dropout_p()
            ));
        }
        match &self.bias {
            Bias::None => None,
            Bias::Other(_) => Some(format!(
                "bias = {} is outside docs/semantics.md §1.9",
                self.bias
            )),
            _ if !computes_bias => Some(format!(
                "bias = {}: this implementation does not compute bias (docs/semantics.md §1.9)",
                self.bias
            )),
            _ => None,
        }
    }

    /// Whether the config's bias type and the bias values in `params` agree (a post-scale
    /// bias of the named broadcast, ALiBi slopes, or none).
    ///
    /// # Errors
    /// [`Error::Config`] naming the key, the tensor and the shapes.
    pub fn check_bias_values(&self, slots: usize) -> Result<()> {
        let p = &self.params;
        let err = |what: String| Err(Error::config(what));
        match (&self.bias, &p.bias) {
            (Bias::None | Bias::Other(_), AttnBias::None) => Ok(()),
            (Bias::Alibi, AttnBias::Alibi(_)) => Ok(()),
            (Bias::PostScale(shape), AttnBias::PostScale(t)) => {
                let (bb, hb, _, _) = t.dim();
                let want_b = if shape.per_slot() { slots } else { 1 };
                let want_h = if shape.per_head() { p.num_heads } else { 1 };
                if (bb, hb) == (want_b, want_h) {
                    Ok(())
                } else {
                    err(format!(
                        "tensor bias: shape [{bb}, {hb}, {}, {}] does not match bias_shape = {} ([{want_b}, {want_h}, Sq, Sk])",
                        t.dim().2,
                        t.dim().3,
                        shape.name()
                    ))
                }
            }
            (Bias::PostScale(_), _) => err("bias = post_scale_bias needs the tensor bias".into()),
            (Bias::Alibi, _) => err("bias = alibi needs the tensor alibi_slopes".into()),
            (b, values) => err(format!(
                "bias = {b} carries the tensor of bias = {}",
                values.name()
            )),
        }
    }

    /// Parses the `smallseq.config` JSON object. Unknown keys and ill-typed values are errors;
    /// missing optional keys take the defaults of `docs/semantics.md` §2.2.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key and the value.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::config(format!("smallseq.config is not JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Error::config(format!(
                "smallseq.config must be a JSON object, got {value}"
            )));
        };
        if let Some(k) = map.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(Error::config(format!(
                "unknown key '{k}' in smallseq.config"
            )));
        }
        let dtype: Dtype = req_str(&map, "dtype")?.parse().map_err(Error::config)?;
        let num_heads = req_usize(&map, "num_heads")?;
        let num_gqa_groups = req_usize(&map, "num_gqa_groups")?;
        let head_dim_qk = req_usize(&map, "head_dim_qk")?;
        let head_dim_v = req_usize(&map, "head_dim_v")?;
        let mask: Mask = req_str(&map, "mask")?.parse().map_err(Error::config)?;
        let window = match map.get("window") {
            None => Window::NONE,
            Some(v) => parse_window(v)?,
        };
        let bias = match map.get("bias") {
            None => Bias::None,
            Some(Value::String(s)) if s == "none" => Bias::None,
            Some(Value::String(s)) if s == "post_scale_bias" => {
                Bias::PostScale(parse_bias_shape(map.get("bias_shape"))?)
            }
            Some(Value::String(s)) if s == "alibi" => Bias::Alibi,
            Some(Value::String(s)) => Bias::Other(s.clone()),
            Some(v) => return Err(ill_typed("bias", v, "a string")),
        };
        if let (Some(v), false) = (map.get("bias_shape"), matches!(bias, Bias::PostScale(_))) {
            return Err(Error::config(format!(
                "key 'bias_shape' = {v}: only bias = post_scale_bias has a shape (bias = {bias})"
            )));
        }
        let p = opt_f64(&map, "dropout")?.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::config(format!("dropout = {p}: must be in [0, 1]")));
        }
        let dropout = Dropout {
            p,
            seed: opt_u64(&map, "dropout_seed")?.unwrap_or(0),
            offset: opt_u64(&map, "dropout_offset")?.unwrap_or(0),
        };
        let scale = opt_f64(&map, "scale")?.unwrap_or(1.0 / (head_dim_qk as f64).sqrt());
        let layout = match map.get("layout") {
            None => LayoutKind::Thd,
            Some(Value::String(s)) if s == "thd" => LayoutKind::Thd,
            Some(Value::String(s)) if s == "bshd" => LayoutKind::Bshd,
            Some(v) => return Err(ill_typed("layout", v, "\"thd\" or \"bshd\"")),
        };
        let cfg = AttnConfig {
            dtype,
            params: AttnParams {
                num_heads,
                num_kv_heads: num_gqa_groups,
                head_dim_qk,
                head_dim_v,
                mask,
                window,
                scale,
                dropout,
                bias: AttnBias::None,
            },
            bias,
            layout,
        };
        smallseq_reference::check_params(&cfg.params)?;
        Ok(cfg)
    }

    /// The `smallseq.config` JSON object, every key written (`bias_shape` with a post-scale
    /// bias only, the one bias that has a shape).
    pub fn to_json(&self) -> String {
        let mut v = serde_json::json!({
            "dtype": self.dtype.name(),
            "num_heads": self.params.num_heads,
            "num_gqa_groups": self.params.num_kv_heads,
            "head_dim_qk": self.params.head_dim_qk,
            "head_dim_v": self.params.head_dim_v,
            "mask": self.params.mask.name(),
            "window": [self.params.window.left, self.params.window.right],
            "bias": self.bias.to_string(),
            "dropout": self.params.dropout.p,
            "dropout_seed": self.params.dropout.seed,
            "dropout_offset": self.params.dropout.offset,
            "scale": self.params.scale,
            "layout": self.layout.name(),
        });
        if let (Bias::PostScale(shape), Some(m)) = (&self.bias, v.as_object_mut()) {
            m.insert("bias_shape".into(), shape.name().into());
        }
        v.to_string()
    }
}

fn ill_typed(key: &str, v: &Value, expected: &str) -> Error {
    Error::config(format!("key '{key}' = {v}: expected {expected}"))
}

fn req<'a>(map: &'a Map<String, Value>, key: &str) -> Result<&'a Value> {
    map.get(key)
        .ok_or_else(|| Error::config(format!("missing key '{key}' in smallseq.config")))
}

fn req_str<'a>(map: &'a Map<String, Value>, key: &str) -> Result<&'a str> {
    let v = req(map, key)?;
    v.as_str().ok_or_else(|| ill_typed(key, v, "a string"))
}

fn req_usize(map: &Map<String, Value>, key: &str) -> Result<usize> {
    let v = req(map, key)?;
    v.as_u64()
        .filter(|n| (1..=1 << 20).contains(n))
        .map(|n| n as usize)
        .ok_or_else(|| ill_typed(key, v, "an integer in 1..=1048576"))
}

fn opt_f64(map: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match map.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ill_typed(key, v, "a finite number")),
    }
}

fn opt_u64(map: &Map<String, Value>, key: &str) -> Result<Option<u64>> {
    match map.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| ill_typed(key, v, "an integer in 0..=18446744073709551615")),
    }
}

fn parse_bias_shape(v: Option<&Value>) -> Result<BiasShape> {
    match v {
        None => Ok(BiasShape::OneHss),
        Some(Value::String(s)) => BiasShape::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                ill_typed(
                    "bias_shape",
                    &Value::String(s.clone()),
                    "\"1hss\", \"11ss\", \"b1ss\" or \"bhss\"",
                )
            }),
        Some(v) => Err(ill_typed(
            "bias_shape",
            v,
            "\"1hss\", \"11ss\", \"b1ss\" or \"bhss\"",
        )),
    }
}

fn parse_window(v: &Value) -> Result<Window> {
    let pair = v
        .as_array()
        .filter(|a| a.len() == 2)
        .and_then(|a| Some((a[0].as_i64()?, a[1].as_i64()?)));
    match pair {
        Some((left, right)) if left >= -1 && right >= -1 => Ok(Window { left, right }),
        _ => Err(ill_typed("window", v, "[left, right] with integers >= -1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_defaults() {
        let mut c = AttnConfig::new(Dtype::F16, 8, 64, Mask::CausalBottomRight);
        c.params.num_kv_heads = 2;
        c.params.window = Window { left: 3, right: 0 };
        assert_eq!(AttnConfig::from_json(&c.to_json()).unwrap(), c);
        // Seeds use all 64 bits; p = 1 is allowed (every element dropped).
        c.params.dropout = Dropout {
            p: 1.0,
            seed: u64::MAX,
            offset: 1 << 40,
        };
        assert_eq!(AttnConfig::from_json(&c.to_json()).unwrap(), c);
        for b in BiasShape::ALL
            .map(Bias::PostScale)
            .into_iter()
            .chain([Bias::Alibi, Bias::Other("pre_scale_bias".into())])
        {
            c.bias = b;
            assert_eq!(AttnConfig::from_json(&c.to_json()).unwrap(), c);
        }
        let min = r#"{"dtype":"bf16","num_heads":2,"num_gqa_groups":1,"head_dim_qk":64,"head_dim_v":32,"mask":"padding"}"#;
        let d = AttnConfig::from_json(min).unwrap();
        assert_eq!(d.params.window, Window::NONE);
        assert_eq!(d.params.scale, 0.125);
        assert_eq!(d.layout, LayoutKind::Thd);
    }

    #[test]
    fn rejects_bad_keys_and_types() {
        let base = r#"{"dtype":"bf16","num_heads":2,"num_gqa_groups":1,"head_dim_qk":64,"head_dim_v":64,"mask":"padding""#;
        for (extra, needle) in [
            (r#","colour":1}"#, "unknown key 'colour'"),
            (r#","scale":"x"}"#, "key 'scale'"),
            (r#","window":[1]}"#, "key 'window'"),
            (r#","layout":"sbhd"}"#, "key 'layout'"),
            (r#","dropout":1.5}"#, "dropout = 1.5"),
            (r#","dropout_seed":-1}"#, "key 'dropout_seed' = -1"),
            (r#","dropout_offset":0.5}"#, "key 'dropout_offset' = 0.5"),
            (
                r#","bias":"post_scale_bias","bias_shape":"hs"}"#,
                "key 'bias_shape' = \"hs\"",
            ),
            (r#","bias_shape":"1hss"}"#, "only bias = post_scale_bias"),
        ] {
            let err = AttnConfig::from_json(&format!("{base}{extra}")).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
        }
        let err = AttnConfig::from_json(
            &base
                .replace("\"num_gqa_groups\":1", "\"num_gqa_groups\":3")
                .replace("\"padding\"", "\"padding\"}"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("num_gqa_groups = 3"), "{err}");
    }
}
