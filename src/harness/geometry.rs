//! What a case is before its tensor values are drawn: its geometry and how its data is drawn.
//! Apart from the generator (`gen`) so that the production shapes (`shapes`) and the generator
//! both build on it without importing each other.

use super::data_class::DataClass;
use super::rng::Draw;
use crate::config::AttnConfig;
use crate::segments::Segmented;
use smallseq_reference::Layout;

/// How input values are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataDist {
    /// Standard normal.
    Randn,
    /// Sparse small integers (exact in every dtype).
    SmallInts,
    /// Mostly small values with a few large spikes (peaked softmax).
    Spiky,
    /// Near-tie logits (tiny q), so P is close to uniform.
    NearTie,
    /// Large magnitudes (tests max-subtraction and overflow handling).
    Large,
}

impl DataDist {
    pub const ALL: [DataDist; 5] = [
        DataDist::Randn,
        DataDist::SmallInts,
        DataDist::Spiky,
        DataDist::NearTie,
        DataDist::Large,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DataDist::Randn => "randn",
            DataDist::SmallInts => "small_ints",
            DataDist::Spiky => "spiky",
            DataDist::NearTie => "near_tie",
            DataDist::Large => "large",
        }
    }
}

/// Everything but the tensor values.
#[derive(Clone, Debug)]
pub struct Geometry {
    pub config: AttnConfig,
    pub layout: Layout,
    pub backward: bool,
    pub dist: DataDist,
    /// Fill don't-care input tokens with NaN, ±Inf and huge values.
    pub poison: bool,
    /// The JAX-style segment ids the layout was drawn as (several segments per row, padding
    /// inside), stored with the case and converted on the way to the kernels.
    pub segments: Option<Segmented>,
    /// Data shaped against the tile structure, on top of `dist`.
    pub data: DataClass,
    /// Drawn by `shapes::draw_production`.
    pub production: bool,
}

/// The data-side choices every geometry ends with.
pub(super) fn with_data<D: Draw>(
    d: &mut D,
    config: AttnConfig,
    layout: Layout,
    segments: Option<Segmented>,
) -> Geometry {
    Geometry {
        config,
        layout,
        backward: d.percent(85),
        dist: d.pick(&DataDist::ALL),
        poison: d.percent(70),
        segments,
        data: DataClass::Plain,
        production: false,
    }
}
