//! One line of the table: a figure, its baseline, and the target their
//! ratio is held to.

use serde::Serialize;

/// What a row's ratio must satisfy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// ratio <= x
    AtMost(f64),
    /// ratio >= x
    AtLeast(f64),
    /// value <= x in the row's unit (no baseline)
    ValueAtMost(f64),
}

impl Target {
    /// As the table prints it.
    pub fn describe(&self, unit: &str) -> String {
        match *self {
            Target::AtMost(x) => format!("<= {x}x"),
            Target::AtLeast(x) => format!(">= {x}x"),
            Target::ValueAtMost(x) => format!("<= {x} {unit}"),
        }
    }
}

impl Serialize for Target {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json {
            kind: &'static str,
            bound: f64,
        }
        let (kind, bound) = match *self {
            Target::AtMost(x) => ("ratio_at_most", x),
            Target::AtLeast(x) => ("ratio_at_least", x),
            Target::ValueAtMost(x) => ("value_at_most", x),
        };
        Json { kind, bound }.serialize(s)
    }
}

/// One line of the table (and one object of the JSON `rows`).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Short key, for `--filter`.
    pub key: &'static str,
    /// What is measured.
    pub figure: String,
    /// What it is compared with.
    pub baseline: String,
    /// Unit of `value` and `baseline_value`.
    pub unit: &'static str,
    /// Median of the figure.
    #[serde(rename = "median")]
    pub value: Option<f64>,
    /// Median of the baseline.
    #[serde(rename = "baseline_median")]
    pub baseline_value: Option<f64>,
    /// The ratio the target is about.
    pub ratio: Option<f64>,
    /// The target.
    pub target: Target,
    /// Whether the target is met; `None` when the row could not be measured.
    pub met: Option<bool>,
    /// Why a row could not be measured, or how to read it.
    pub note: Option<String>,
}

impl Row {
    /// A row not measured yet.
    pub fn new(
        key: &'static str,
        figure: &str,
        baseline: &str,
        unit: &'static str,
        target: Target,
    ) -> Self {
        Self {
            key,
            figure: figure.into(),
            baseline: baseline.into(),
            value: None,
            baseline_value: None,
            unit,
            ratio: None,
            target,
            met: None,
            note: None,
        }
    }

    /// The measured values, and whether the target is met.
    pub fn with(mut self, value: f64, baseline: Option<f64>, ratio: Option<f64>) -> Self {
        self.value = Some(value);
        self.baseline_value = baseline;
        self.ratio = ratio;
        self.met = Some(match self.target {
            Target::AtMost(x) => ratio.is_some_and(|r| r <= x),
            Target::AtLeast(x) => ratio.is_some_and(|r| r >= x),
            Target::ValueAtMost(x) => value <= x,
        });
        self
    }

    /// A note printed under the table.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}
