//! A tiny ONNX model, written from Rust: `Y = X · W + B`.
//!
//! ONNX models are protobuf messages. This module encodes the handful of
//! fields a MatMul + Add graph needs (field numbers from `onnx.proto`), so the
//! tests and the example need no download, no Python and no checked-in
//! binary. [`MatMulAdd::reference`] computes the same function in Rust, which
//! is what the tests compare ONNX Runtime's numbers against.

/// ONNX `TensorProto.DataType.FLOAT`.
const FLOAT: u64 = 1;

/// A protobuf message under construction.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn varint(&mut self, mut v: u64) {
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                self.0.push(byte);
                return;
            }
            self.0.push(byte | 0x80);
        }
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }

    /// Wire type 0.
    fn int(&mut self, field: u32, v: u64) -> &mut Self {
        self.key(field, 0);
        self.varint(v);
        self
    }

    /// Wire type 2.
    fn bytes(&mut self, field: u32, b: &[u8]) -> &mut Self {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }

    fn str(&mut self, field: u32, s: &str) -> &mut Self {
        self.bytes(field, s.as_bytes())
    }

    fn msg(&mut self, field: u32, m: Msg) -> &mut Self {
        self.bytes(field, &m.0)
    }
}

/// `TensorProto` holding `values` as raw little-endian floats.
fn tensor(name: &str, dims: &[usize], values: &[f32]) -> Msg {
    let mut t = Msg::default();
    for &d in dims {
        t.int(1, d as u64); // dims
    }
    t.int(2, FLOAT); // data_type
    t.str(8, name); // name
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    t.bytes(9, &raw); // raw_data
    t
}

/// `ValueInfoProto` of a float tensor; `None` dims are symbolic (`"N"`).
fn value_info(name: &str, dims: &[Option<usize>]) -> Msg {
    let mut shape = Msg::default();
    for d in dims {
        let mut dim = Msg::default();
        match d {
            Some(n) => dim.int(1, *n as u64), // dim_value
            None => dim.str(2, "N"),          // dim_param
        };
        shape.msg(1, dim);
    }
    let mut tensor_type = Msg::default();
    tensor_type.int(1, FLOAT).msg(2, shape); // elem_type, shape
    let mut ty = Msg::default();
    ty.msg(1, tensor_type); // tensor_type
    let mut v = Msg::default();
    v.str(1, name).msg(2, ty);
    v
}

fn node(op: &str, inputs: &[&str], output: &str) -> Msg {
    let mut n = Msg::default();
    for i in inputs {
        n.str(1, i);
    }
    n.str(2, output).str(3, &op.to_lowercase()).str(4, op);
    n
}

/// `Y[N, n] = X[N, k] · W[k, n] + B[n]`, with fixed, generated weights.
#[derive(Debug, Clone, PartialEq)]
pub struct MatMulAdd {
    /// Inner dimension (columns of `X`).
    pub k: usize,
    /// Output width.
    pub n: usize,
    /// `W`, row-major `k × n`.
    pub w: Vec<f32>,
    /// `B`, `n` values.
    pub b: Vec<f32>,
}

impl MatMulAdd {
    /// The model with `W[i][j] = (i·n + j) / 8 − 1` and `B[j] = j / 2`: small
    /// exact binary fractions, so results compare exactly.
    pub fn new(k: usize, n: usize) -> Self {
        let w = (0..k * n).map(|i| i as f32 / 8.0 - 1.0).collect();
        let b = (0..n).map(|j| j as f32 / 2.0).collect();
        Self { k, n, w, b }
    }

    /// The serialized `ModelProto` (IR version 8, opset 13).
    pub fn to_onnx(&self) -> Vec<u8> {
        let mut graph = Msg::default();
        graph
            .msg(1, node("MatMul", &["X", "W"], "XW"))
            .msg(1, node("Add", &["XW", "B"], "Y"))
            .str(2, "matmul_add")
            .msg(5, tensor("W", &[self.k, self.n], &self.w))
            .msg(5, tensor("B", &[self.n], &self.b))
            .msg(11, value_info("X", &[None, Some(self.k)]))
            .msg(12, value_info("Y", &[None, Some(self.n)]));
        let mut opset = Msg::default();
        opset.str(1, "").int(2, 13);
        let mut model = Msg::default();
        model
            .int(1, 8) // ir_version
            .str(2, "memgov-onnxruntime") // producer_name
            .msg(7, graph)
            .msg(8, opset);
        model.0
    }

    /// `X · W + B` for `x` of `rows × k`, computed here.
    pub fn reference(&self, x: &[f32]) -> Vec<f32> {
        let rows = x.len() / self.k;
        let mut y = Vec::with_capacity(rows * self.n);
        for r in 0..rows {
            for j in 0..self.n {
                let dot: f32 = (0..self.k)
                    .map(|i| x[r * self.k + i] * self.w[i * self.n + j])
                    .sum();
                y.push(dot + self.b[j]);
            }
        }
        y
    }

    /// A deterministic input of `rows × k`.
    pub fn input(&self, rows: usize) -> Vec<f32> {
        (0..rows * self.k).map(|i| (i % 7) as f32 - 3.0).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_the_model_are_well_formed() {
        let mut m = Msg::default();
        m.varint(300);
        assert_eq!(m.0, [0xac, 0x02]);
        let model = MatMulAdd::new(3, 4);
        let bytes = model.to_onnx();
        // ir_version = 8, then producer_name.
        assert_eq!(&bytes[..4], &[0x08, 0x08, 0x12, 18]);
        assert!(bytes.len() < 512, "a few hundred bytes: {}", bytes.len());
        let y = model.reference(&[1.0, 0.0, 0.0, 0.0, 1.0, 0.0]);
        // Row 0 picks W's row 0, row 1 picks W's row 1, plus B.
        assert_eq!(y, [-1.0, -0.375, 0.25, 0.875, -0.5, 0.125, 0.75, 1.375]);
    }
}
