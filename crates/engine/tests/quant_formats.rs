//! Dequantisation of every format against fixtures written by independent references
//! (`tools/make_quant_fixtures.py`: the `gguf` package's numpy code, and numpy written from the
//! format specs for Q2_0, NVFP4 and FP8), and the GGUF reader end to end.

use capy_engine::quant::fp8::{self, Fp8Scaling};
use capy_engine::quant::gguf::{GgufFile, GgufValue};
use capy_engine::quant::nvfp4::Nvfp4Matrix;
use capy_engine::quant::{ggml, GgmlType};
use std::path::PathBuf;

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quant")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e} (regenerate with tools/make_quant_fixtures.py)",
            p.display()
        )
    })
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn assert_bits_equal(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{name}[{i}]: got {g}, reference {w}"
        );
    }
}

#[test]
fn ggml_types_match_the_gguf_package_bit_for_bit() {
    for ty in GgmlType::ALL {
        let stem = ty.name().to_ascii_lowercase();
        let raw = fixture(&format!("{stem}.bin"));
        let want = f32s(&fixture(&format!("{stem}.f32")));
        assert!(!want.is_empty());
        let mut got = vec![0f32; want.len()];
        ggml::dequantize(ty, &raw, &mut got).unwrap();
        assert_bits_equal(ty.name(), &got, &want);
    }
}

#[test]
fn nvfp4_matches_the_independent_reference() {
    let (n, k) = (16, 128);
    let raw = fixture("nvfp4.bin");
    let codes = &raw[..n * k / 2];
    let scales = &raw[n * k / 2..n * k / 2 + n * k / 16];
    let scale_2 = f32::from_le_bytes(raw[raw.len() - 4..].try_into().unwrap());
    let m = Nvfp4Matrix::new("fixture", n, k, codes, scales, scale_2).unwrap();
    assert_bits_equal("nvfp4", &m.to_f32(), &f32s(&fixture("nvfp4.f32")));
}

#[test]
fn fp8_block_and_row_scales_match_the_independent_reference() {
    let (n, k) = (200, 300);
    let raw = fixture("fp8_block.bin");
    let got = fp8::dequantize(
        "block",
        &raw[..n * k],
        n,
        k,
        &f32s(&raw[n * k..]),
        Fp8Scaling::Block {
            rows: 128,
            cols: 128,
        },
    )
    .unwrap();
    assert_bits_equal("fp8 block", &got, &f32s(&fixture("fp8_block.f32")));
    let raw = fixture("fp8_row.bin");
    let got = fp8::dequantize(
        "row",
        &raw[..n * k],
        n,
        k,
        &f32s(&raw[n * k..]),
        Fp8Scaling::Row,
    )
    .unwrap();
    assert_bits_equal("fp8 row", &got, &f32s(&fixture("fp8_row.f32")));
}

fn json_to_value(v: &serde_json::Value) -> Option<GgufValue> {
    Some(match v {
        serde_json::Value::String(s) => GgufValue::String(s.clone()),
        serde_json::Value::Bool(b) => GgufValue::Bool(*b),
        _ => return None,
    })
}

#[test]
fn gguf_reader_reads_the_gguf_writers_file() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant");
    let f = GgufFile::open(&dir.join("small.gguf")).unwrap();
    let expect: serde_json::Value = serde_json::from_slice(&fixture("small.gguf.json")).unwrap();
    assert_eq!(f.version as u64, expect["version"].as_u64().unwrap());
    assert_eq!(f.alignment as u64, expect["alignment"].as_u64().unwrap());
    for (key, want) in expect["metadata"].as_object().unwrap() {
        let got = f
            .meta(key)
            .unwrap_or_else(|| panic!("metadata {key} missing"));
        match want {
            serde_json::Value::Number(n) if n.is_f64() => {
                assert_eq!(got.as_f64(), n.as_f64(), "{key}")
            }
            serde_json::Value::Number(n) => assert_eq!(got.as_i64(), n.as_i64(), "{key}"),
            serde_json::Value::Array(items) => {
                let got = got
                    .as_array()
                    .unwrap_or_else(|| panic!("{key} is not an array"));
                assert_eq!(got.len(), items.len(), "{key}");
                for (g, w) in got.iter().zip(items) {
                    match json_to_value(w) {
                        Some(w) => assert_eq!(g, &w, "{key}"),
                        None => assert_eq!(g.as_i64(), w.as_i64(), "{key}"),
                    }
                }
            }
            _ => assert_eq!(Some(got.clone()), json_to_value(want), "{key}"),
        }
    }
    // Each metadata type keeps its width.
    assert_eq!(f.meta("test.u8"), Some(&GgufValue::U8(200)));
    assert_eq!(f.meta("test.i16"), Some(&GgufValue::I16(-30000)));
    assert_eq!(f.meta("test.f64"), Some(&GgufValue::F64(2.25)));
    let tensors = expect["tensors"].as_object().unwrap();
    assert_eq!(f.tensors.len(), tensors.len());
    for (name, want) in tensors {
        let t = f
            .get(name)
            .unwrap_or_else(|| panic!("tensor {name} missing"));
        assert_eq!(t.ty.name(), want["type"].as_str().unwrap(), "{name}");
        let dims: Vec<u64> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{name}");
        assert_eq!(t.offset % f.alignment, 0, "{name}");
        let values: Vec<f32> = want["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_bits_equal(name, &f.to_f32(name).unwrap(), &values);
    }
}

/// Writes `bytes` to a temporary file and opens it as GGUF, returning the error text.
fn open_error(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, bytes).unwrap();
    format!(
        "{:#}",
        GgufFile::open(&p)
            .err()
            .expect("a corrupt file must be refused")
    )
}

/// A minimal GGUF file with one tensor: `name`, dims, type id, offset, and `data_len` data bytes.
fn tiny_gguf(name: &str, dims: &[u64], ty: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(name.len() as u64).to_le_bytes());
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    b.resize(b.len().next_multiple_of(32), 0);
    b.resize(b.len() + data_len, 0x11);
    b
}

#[test]
fn gguf_reader_opens_a_well_formed_tiny_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ok.gguf");
    std::fs::write(
        &p,
        tiny_gguf("blk.0.ffn_down.weight", &[64, 2], 8, 0, 2 * 68),
    )
    .unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.get("blk.0.ffn_down.weight").unwrap().shape(), vec![2, 64]);
}

#[test]
fn gguf_reader_refuses_corrupt_files_naming_the_tensor() {
    let name = "blk.3.ffn_gate_exps.weight";
    let good = tiny_gguf(name, &[64, 2], 8, 0, 2 * 68);
    // Truncated inside the tensor data.
    let e = open_error(&good[..good.len() - 1]);
    assert!(e.contains(name) && e.contains("past the end"), "{e}");
    // Truncated inside the tensor info.
    let e = open_error(&good[..70]);
    assert!(e.contains("truncated") && e.contains(name), "{e}");
    // Misaligned offset.
    let e = open_error(&tiny_gguf(name, &[64, 2], 8, 4, 2 * 68 + 4));
    assert!(e.contains(name) && e.contains("alignment"), "{e}");
    // Unknown and unsupported types.
    let e = open_error(&tiny_gguf(name, &[64, 2], 77, 0, 2 * 68));
    assert!(e.contains(name) && e.contains("id 77"), "{e}");
    let e = open_error(&tiny_gguf(name, &[256, 2], 12, 0, 2 * 144));
    assert!(e.contains(name) && e.contains("Q4_K"), "{e}");
    // Row not a whole number of blocks.
    let e = open_error(&tiny_gguf(name, &[48, 2], 8, 0, 2 * 68));
    assert!(e.contains(name) && e.contains("whole number"), "{e}");
    // Not GGUF at all.
    let e = open_error(b"GGML\x03\0\0\0");
    assert!(e.contains("magic"), "{e}");
}
