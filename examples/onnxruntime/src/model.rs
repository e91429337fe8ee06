//! A tiny ONNX model, written from Rust: `Y = X · W + B`.
//!
//! ONNX models are protobuf messages. This module encodes the handful of
//! fields a MatMul + Add graph needs (field numbers from `onnx.proto`), so the
//! tests and the example need no download, no Python and no checked-in
//! binary. [`MatMulAdd::reference`] computes the same function in Rust, which
//! is what the tests compare ONNX Runtime's numbers against.

/// ONNX `TensorProto.DataType.FLOAT`.
const FLOAT: u64 = 1;
/// ONNX `TensorProto.DataType.BOOL`.
const BOOL: u64 = 9;

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
    typed_value_info(name, FLOAT, dims)
}

/// `ValueInfoProto` of a tensor of `elem_type`.
fn typed_value_info(name: &str, elem_type: u64, dims: &[Option<usize>]) -> Msg {
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
    tensor_type.int(1, elem_type).msg(2, shape); // elem_type, shape
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
        model(graph)
    }

    /// The same model with `B` the output of a `Constant` node instead of
    /// an initializer (how some exporters store every weight).
    pub fn to_onnx_constant_bias(&self) -> Vec<u8> {
        let mut value = Msg::default();
        value
            .str(1, "value") // name
            .msg(5, tensor("B", &[self.n], &self.b)) // t
            .int(20, 4); // type = TENSOR
        let mut constant = node("Constant", &[], "B");
        constant.msg(5, value);
        let mut graph = Msg::default();
        graph
            .msg(1, constant)
            .msg(1, node("MatMul", &["X", "W"], "XW"))
            .msg(1, node("Add", &["XW", "B"], "Y"))
            .str(2, "matmul_add")
            .msg(5, tensor("W", &[self.k, self.n], &self.w))
            .msg(11, value_info("X", &[None, Some(self.k)]))
            .msg(12, value_info("Y", &[None, Some(self.n)]));
        model(graph)
    }

    /// The same model with `B` an initializer of both branches of an `If`
    /// on the boolean input `C` (how some exporters store every weight):
    /// `Y = X·W + B` when `C` is true, `X·W − B` when it is false.
    pub fn to_onnx_bias_in_branches(&self) -> Vec<u8> {
        let branch = |op: &str, name: &str, b: &str| {
            let mut g = Msg::default();
            g.msg(1, node(op, &["XW", b], name))
                .str(2, name)
                .msg(5, tensor(b, &[self.n], &self.b))
                .msg(12, value_info(name, &[None, Some(self.n)]));
            g
        };
        let attr = |name: &str, g: Msg| {
            let mut a = Msg::default();
            a.str(1, name).msg(6, g).int(20, 5); // g, type = GRAPH
            a
        };
        let mut branch_node = node("If", &["C"], "Y");
        branch_node
            .msg(5, attr("then_branch", branch("Add", "then_y", "B_then")))
            .msg(5, attr("else_branch", branch("Sub", "else_y", "B_else")));
        let cond = typed_value_info("C", BOOL, &[]); // a scalar
        let mut graph = Msg::default();
        graph
            .msg(1, node("MatMul", &["X", "W"], "XW"))
            .msg(1, branch_node)
            .str(2, "matmul_if_add")
            .msg(5, tensor("W", &[self.k, self.n], &self.w))
            .msg(11, value_info("X", &[None, Some(self.k)]))
            .msg(11, cond)
            .msg(12, value_info("Y", &[None, Some(self.n)]));
        model(graph)
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

/// One `ConvTranspose` node, `Y = ConvTranspose(X[1, c, h, w], W[c, m, k, k])`:
/// ONNX Runtime prepacks its weights while a session is created, and that
/// prepacking writes to what `Alloc` returned without checking it for null.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTranspose {
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub m: usize,
    /// Kernel side.
    pub k: usize,
    /// Input height and width.
    pub hw: usize,
}

impl ConvTranspose {
    /// The serialized `ModelProto` (IR version 8, opset 13).
    pub fn to_onnx(&self) -> Vec<u8> {
        let w: Vec<f32> = (0..self.c * self.m * self.k * self.k)
            .map(|i| (i % 5) as f32 / 4.0 - 0.5)
            .collect();
        let out = self.hw + self.k - 1;
        let mut graph = Msg::default();
        graph
            .msg(1, node("ConvTranspose", &["X", "W"], "Y"))
            .str(2, "conv_transpose")
            .msg(5, tensor("W", &[self.c, self.m, self.k, self.k], &w))
            .msg(
                11,
                value_info("X", &[Some(1), Some(self.c), Some(self.hw), Some(self.hw)]),
            )
            .msg(
                12,
                value_info("Y", &[Some(1), Some(self.m), Some(out), Some(out)]),
            );
        model(graph)
    }
}

fn model(graph: Msg) -> Vec<u8> {
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

/// One field of a protobuf message: its number and its value.
enum Field<'a> {
    Int(u64),
    Bytes(&'a [u8]),
}

/// The fields of the protobuf message `b`, in order.
fn fields(mut b: &[u8]) -> Result<Vec<(u32, Field<'_>)>, String> {
    fn varint(b: &mut &[u8]) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = b.split_first().ok_or("truncated varint")?;
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint longer than 10 bytes".into())
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let field = u32::try_from(key >> 3).map_err(|_| "field number out of range")?;
        let value = match key & 7 {
            0 => Field::Int(varint(&mut b)?),
            1 | 5 => {
                let n = if key & 7 == 1 { 8 } else { 4 };
                let (v, rest) = b.split_at_checked(n).ok_or("truncated fixed field")?;
                b = rest;
                let mut le = [0u8; 8];
                le[..n].copy_from_slice(v);
                Field::Int(u64::from_le_bytes(le))
            }
            2 => {
                let len = usize::try_from(varint(&mut b)?).map_err(|_| "length out of range")?;
                let (v, rest) = b.split_at_checked(len).ok_or("truncated field")?;
                b = rest;
                Field::Bytes(v)
            }
            w => return Err(format!("wire type {w} is not used by ONNX")),
        };
        out.push((field, value));
    }
    Ok(out)
}

/// Bytes per element of ONNX data type `t`, for the fixed-size types.
fn element_size(t: i32) -> Option<u64> {
    Some(match t {
        2 | 3 | 9 => 1,       // uint8, int8, bool
        4 | 5 | 10 | 16 => 2, // uint16, int16, float16, bfloat16
        1 | 6 | 12 => 4,      // float, int32, uint32
        7 | 11 | 13 => 8,     // int64, double, uint64
        _ => return None,
    })
}

/// What a weight of a model file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightKind {
    /// An initializer of a graph.
    Initializer,
    /// The value of a `Constant` node (ONNX Runtime turns it into an
    /// initializer when it loads the model).
    Constant,
    /// A tensor attribute of another node (`ConstantOfShape`'s value, for
    /// one): part of the node, not an initializer.
    Attribute,
}

/// One weight tensor of a model file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Weight {
    /// The tensor's name (for a `Constant` node, its output).
    pub name: String,
    /// What it is.
    pub kind: WeightKind,
    /// Whether it belongs to a subgraph (the branch of an `If`, the body of
    /// a `Loop`) rather than to the main graph.
    pub in_subgraph: bool,
    /// ONNX data type (`TensorProto.DataType`).
    pub data_type: i32,
    /// Dimensions.
    pub dims: Vec<i64>,
    /// Bytes of its data once loaded: elements × element size (for strings
    /// and other variable-size types, the bytes of its data in the file).
    pub bytes: u64,
    /// Where the data sits in the file, when it is stored as `raw_data` (or
    /// as packed `float_data` / `double_data`, which hold the same bytes) in
    /// a fixed-size type whose length matches the dimensions: what can be
    /// copied into a tensor as is.
    pub raw: Option<std::ops::Range<usize>>,
}

/// Every weight tensor in the ONNX model `model`, in the main graph and in
/// its subgraphs: initializers, the values of `Constant` nodes, and tensor
/// attributes of other nodes.
/// Weights stored in external files are listed with the bytes of their
/// in-file description only.
///
/// # Errors
///
/// A message if `model` is not a well-formed protobuf message.
pub fn weights(model: &[u8]) -> Result<Vec<Weight>, String> {
    let base = model.as_ptr() as usize;
    let mut out = Vec::new();
    for (f, v) in fields(model)? {
        if let (7, Field::Bytes(g)) = (f, v) {
            graph_weights(g, base, true, &mut out)?;
        }
    }
    Ok(out)
}

fn graph_weights(g: &[u8], base: usize, top: bool, out: &mut Vec<Weight>) -> Result<(), String> {
    for (f, v) in fields(g)? {
        match (f, v) {
            (1, Field::Bytes(n)) => node_weights(n, base, top, out)?,
            (5, Field::Bytes(t)) => {
                out.push(tensor_weight(t, base, WeightKind::Initializer, top, None)?);
            }
            _ => {}
        }
    }
    Ok(())
}

fn node_weights(n: &[u8], base: usize, top: bool, out: &mut Vec<Weight>) -> Result<(), String> {
    let fs = fields(n)?;
    let constant = fs
        .iter()
        .any(|(f, v)| *f == 4 && matches!(v, Field::Bytes(b"Constant")));
    let output = fs.iter().find_map(|(f, v)| match (f, v) {
        (2, Field::Bytes(o)) => Some(String::from_utf8_lossy(o).into_owned()),
        _ => None,
    });
    for (f, v) in &fs {
        let (5, Field::Bytes(a)) = (f, v) else {
            continue;
        };
        for (af, av) in fields(a)? {
            match (af, av) {
                (5 | 10, Field::Bytes(t)) => {
                    let kind = if constant {
                        WeightKind::Constant
                    } else {
                        WeightKind::Attribute
                    };
                    out.push(tensor_weight(t, base, kind, top, output.clone())?);
                }
                (6 | 11, Field::Bytes(g)) => graph_weights(g, base, false, out)?,
                _ => {}
            }
        }
    }
    Ok(())
}

fn tensor_weight(
    t: &[u8],
    base: usize,
    kind: WeightKind,
    top: bool,
    name: Option<String>,
) -> Result<Weight, String> {
    let mut w = Weight {
        name: name.unwrap_or_default(),
        kind,
        in_subgraph: !top,
        data_type: 0,
        dims: Vec::new(),
        bytes: 0,
        raw: None,
    };
    let mut raw = None;
    let mut typed = 0u64;
    // Packed `float_data` (field 4) and `double_data` (field 10) are the
    // little-endian values back to back: the same bytes as `raw_data`.
    let mut fixed: Vec<(u32, &[u8])> = Vec::new();
    for (f, v) in fields(t)? {
        match (f, v) {
            (1, Field::Int(d)) => w.dims.push(d as i64),
            (1, Field::Bytes(packed)) => {
                for (_, d) in fields_packed(packed)? {
                    w.dims.push(d as i64);
                }
            }
            (2, Field::Int(d)) => w.data_type = d as i32,
            (8, Field::Bytes(n)) if w.name.is_empty() => {
                w.name = String::from_utf8_lossy(n).into_owned();
            }
            (9, Field::Bytes(r)) => raw = Some(r),
            // float, int32, string, int64, double, uint64 data.
            (4..=7 | 10 | 11, Field::Bytes(b)) => {
                typed += b.len() as u64;
                if f == 4 || f == 10 {
                    fixed.push((f, b));
                }
            }
            (4..=7 | 10 | 11, Field::Int(_)) => typed += 8,
            _ => {}
        }
    }
    if raw.is_none() {
        if let [(f, b)] = fixed[..] {
            if (f, w.data_type) == (4, 1) || (f, w.data_type) == (10, 11) {
                raw = Some(b);
            }
        }
    }
    let numel = w
        .dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?));
    match raw {
        Some(r) => {
            w.bytes = r.len() as u64;
            let start = r.as_ptr() as usize - base;
            let fits = element_size(w.data_type)
                .zip(numel)
                .is_some_and(|(size, n)| n > 0 && size * n == w.bytes);
            if fits {
                w.raw = Some(start..start + r.len());
            }
        }
        // Typed fields may be varints: the tensor's size in memory is what
        // its elements take, when they have a fixed size.
        None => {
            w.bytes = element_size(w.data_type)
                .zip(numel)
                .map_or(typed, |(size, n)| size * n);
        }
    }
    Ok(w)
}

/// The varints of a packed repeated field.
fn fields_packed(mut b: &[u8]) -> Result<Vec<(u32, u64)>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let mut v = 0u64;
        let mut shift = 0;
        loop {
            let (&byte, rest) = b.split_first().ok_or("truncated packed varint")?;
            b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            shift += 7;
            if byte & 0x80 == 0 || shift >= 64 {
                break;
            }
        }
        out.push((0, v));
    }
    Ok(out)
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

    #[test]
    fn the_weights_of_a_model_are_found_with_their_bytes() {
        let model = MatMulAdd::new(3, 4);
        let bytes = model.to_onnx();
        let w = weights(&bytes).unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(
            (w[0].name.as_str(), w[0].dims.as_slice()),
            ("W", &[3i64, 4][..])
        );
        assert_eq!((w[0].bytes, w[0].data_type), (48, 1));
        assert_eq!(w[0].kind, WeightKind::Initializer);
        let raw = w[0].raw.clone().unwrap();
        let first = f32::from_le_bytes(bytes[raw.start..raw.start + 4].try_into().unwrap());
        assert_eq!(first, model.w[0]);
        assert_eq!((w[1].name.as_str(), w[1].bytes), ("B", 16));
        let conv = ConvTranspose {
            c: 2,
            m: 3,
            k: 3,
            hw: 4,
        };
        let w = weights(&conv.to_onnx()).unwrap();
        assert_eq!(w[0].bytes, 2 * 3 * 9 * 4);
        assert!(weights(&[0x3a, 0x05, 0x01]).is_err(), "truncated");
    }
}
