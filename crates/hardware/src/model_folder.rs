//! Which configuration of the table a model folder is, so `serve` can check it before loading.
//!
//! [`identify`] is pure: it reads the facts [`FolderFacts`] holds (`config.json`,
//! ModelOpt's `hf_quant_config.json`, the GGUF files and their `general.architecture`) and
//! decides:
//!
//! | model (config.json `model_type`, or its `text_config`'s; else the GGUF architecture) | weights | configuration |
//! |---|---|---|
//! | `qwen3_5` / `qwen3_5_text` (GGUF `qwen35`) | NVFP4 | `qwen3.8-27b-nvfp4` |
//! | `qwen3_5` / `qwen3_5_text` (GGUF `qwen35`) | GGUF | `qwen3.8-27b-gsq3` |
//! | `qwen4_exp` / `qwen4_exp_text` (GGUF `qwen4_exp`, `qwen4exp`) | NVFP4 | `qwen3.8-flash-next-nvfp4` |
//! | `qwen4_exp` / `qwen4_exp_text` (GGUF `qwen4_exp`, `qwen4exp`) | GGUF (experts) | `qwen3.8-flash-next-64g` |
//!
//! - Weights are NVFP4 when a `quant_algo` in `config.json`'s `quantization_config` or in
//!   `hf_quant_config.json` is `NVFP4` (ModelOpt mixed precision names it per layer), or a
//!   `quant_method`/`format` names nvfp4 (compressed-tensors). They are GGUF when the folder
//!   holds a `.gguf` file; GGUF wins over NVFP4 (the 64 GB edition keeps its GSQ-RCO experts in
//!   GGUF beside a `config.json`).
//! - Everything else has no configuration: the built-in demo models (a `capy_demo` key in
//!   `config.json`), tiny test checkpoints, unquantised (BF16) builds and unknown models. `serve`
//!   then checks only the CPU.

use crate::configurations::{self, Configuration, Model};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// What [`identify`] needs to know about a model folder.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FolderFacts {
    /// `config.json`, when present.
    pub config: Option<Value>,
    /// ModelOpt's `hf_quant_config.json`, when present.
    pub hf_quant_config: Option<Value>,
    /// The `.gguf` files of the folder, sorted by name.
    pub gguf_files: Vec<GgufFacts>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GgufFacts {
    pub file_name: String,
    /// `general.architecture` from its header; `None` when it could not be read.
    pub architecture: Option<String>,
}

/// How the weights are stored, as far as the configuration table cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    Nvfp4,
    Gguf,
    /// BF16/F16/F32 safetensors, or a quantisation the table does not list.
    Other,
}

/// The result of [`identify`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Identified {
    /// The model family, when the folder says which.
    pub model: Option<Model>,
    pub weights: WeightFormat,
    /// The configuration of the table this folder is; `None`: not in the table.
    pub configuration: Option<&'static Configuration>,
    /// One sentence on how that was decided (printed by `serve`).
    pub reason: String,
}

/// Map a model folder's facts to its configuration (see the module documentation).
pub fn identify(facts: &FolderFacts) -> Identified {
    let weights = weight_format(facts);
    let config_type = facts.config.as_ref().and_then(model_type_of);
    let gguf_arch = facts
        .gguf_files
        .iter()
        .find_map(|g| g.architecture.as_deref());
    let is_demo = facts
        .config
        .as_ref()
        .is_some_and(|c| c.get("capy_demo").is_some());
    let (model, named_by) = match (config_type, gguf_arch) {
        (Some(t), _) => (model_for_type(&t), format!("model_type \"{t}\"")),
        (None, Some(a)) => (model_for_gguf_arch(a), format!("GGUF architecture \"{a}\"")),
        (None, None) => (None, "no model_type".to_string()),
    };
    let weights_word = match weights {
        WeightFormat::Nvfp4 => "NVFP4 weights",
        WeightFormat::Gguf => "GGUF weights",
        WeightFormat::Other => "unquantised or unlisted weights",
    };
    if is_demo {
        return Identified {
            model: None,
            weights,
            configuration: None,
            reason: "a built-in demo model: not in the configuration table".to_string(),
        };
    }
    let id = match (model, weights) {
        (Some(Model::Qwen3_8_27b), WeightFormat::Nvfp4) => Some("qwen3.8-27b-nvfp4"),
        (Some(Model::Qwen3_8_27b), WeightFormat::Gguf) => Some("qwen3.8-27b-gsq3"),
        (Some(Model::Qwen3_8FlashNext), WeightFormat::Nvfp4) => Some("qwen3.8-flash-next-nvfp4"),
        (Some(Model::Qwen3_8FlashNext), WeightFormat::Gguf) => Some("qwen3.8-flash-next-64g"),
        _ => None,
    };
    let configuration = id.map(|id| configurations::find(id).expect("ids above are in the table"));
    let reason = match configuration {
        Some(c) => format!(
            "{named_by} with {weights_word}: {} ({})",
            c.display_name, c.id
        ),
        None => format!("{named_by} with {weights_word}: not in the configuration table"),
    };
    Identified {
        model,
        weights,
        configuration,
        reason,
    }
}

/// The model type of a `config.json`: the wrapper's, or its `text_config`'s when the wrapper's
/// is not one of ours.
fn model_type_of(config: &Value) -> Option<String> {
    let outer = config.get("model_type").and_then(Value::as_str);
    let inner = config
        .get("text_config")
        .and_then(|t| t.get("model_type"))
        .and_then(Value::as_str);
    match (outer, inner) {
        (Some(o), _) if model_for_type(o).is_some() => Some(o.to_string()),
        (_, Some(i)) if model_for_type(i).is_some() => Some(i.to_string()),
        (Some(o), _) => Some(o.to_string()),
        (None, i) => i.map(str::to_string),
    }
}

fn model_for_type(t: &str) -> Option<Model> {
    match t {
        "qwen3_5" | "qwen3_5_text" => Some(Model::Qwen3_8_27b),
        "qwen4_exp" | "qwen4_exp_text" => Some(Model::Qwen3_8FlashNext),
        _ => None,
    }
}

fn model_for_gguf_arch(a: &str) -> Option<Model> {
    match a {
        "qwen35" => Some(Model::Qwen3_8_27b),
        "qwen4_exp" | "qwen4exp" => Some(Model::Qwen3_8FlashNext),
        _ => None,
    }
}

fn weight_format(facts: &FolderFacts) -> WeightFormat {
    if !facts.gguf_files.is_empty() {
        return WeightFormat::Gguf;
    }
    let quant = facts
        .config
        .as_ref()
        .and_then(|c| c.get("quantization_config"));
    if quant.is_some_and(names_nvfp4) || facts.hf_quant_config.as_ref().is_some_and(names_nvfp4) {
        WeightFormat::Nvfp4
    } else {
        WeightFormat::Other
    }
}

/// Whether a quantisation config names NVFP4 anywhere (`quant_algo: NVFP4`, per-layer
/// `quant_algo`s of ModelOpt mixed precision, or a compressed-tensors `format`).
fn names_nvfp4(v: &Value) -> bool {
    match v {
        Value::Object(map) => map.iter().any(|(k, v)| {
            let named = matches!(k.as_str(), "quant_algo" | "quant_method" | "format")
                && v.as_str()
                    .is_some_and(|s| s.to_ascii_lowercase().contains("nvfp4"));
            named || names_nvfp4(v)
        }),
        Value::Array(items) => items.iter().any(names_nvfp4),
        _ => false,
    }
}

/// Read the facts of `dir` without loading any weights: the two JSON files, the `.gguf` file
/// names, and each GGUF file's architecture through `gguf_architecture` (the caller's GGUF
/// reader; it only needs the header).
pub fn read_folder(
    dir: &Path,
    gguf_architecture: impl Fn(&Path) -> Option<String>,
) -> Result<FolderFacts, String> {
    if !dir.is_dir() {
        return Err(format!(
            "{} is not a folder; give a Hugging Face model folder (config.json, weights, tokenizer) or \"demo\"",
            dir.display()
        ));
    }
    let read_json = |name: &str| -> Result<Option<Value>, String> {
        let path = dir.join(name);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| format!("{} is not valid JSON: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    };
    let config = read_json("config.json")?;
    let hf_quant_config = read_json("hf_quant_config.json")?;
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut ggufs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
        })
        .collect();
    ggufs.sort();
    let gguf_files = ggufs
        .iter()
        .map(|p| GgufFacts {
            file_name: p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            architecture: gguf_architecture(p),
        })
        .collect();
    Ok(FolderFacts {
        config,
        hf_quant_config,
        gguf_files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(v: Value) -> FolderFacts {
        FolderFacts {
            config: Some(v),
            ..Default::default()
        }
    }

    fn gguf(arch: Option<&str>) -> GgufFacts {
        GgufFacts {
            file_name: "model-00001-of-00002.gguf".into(),
            architecture: arch.map(str::to_string),
        }
    }

    fn id_of(f: &FolderFacts) -> Option<&'static str> {
        identify(f).configuration.map(|c| c.id)
    }

    const MODELOPT: &str = "modelopt";

    #[test]
    fn the_four_configurations() {
        let nvfp4 = json!({"quant_method": MODELOPT, "quant_algo": "NVFP4"});
        // The published wrappers, the quantisation in config.json.
        let b27 = cfg(
            json!({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"},
                             "quantization_config": nvfp4}),
        );
        assert_eq!(id_of(&b27), Some("qwen3.8-27b-nvfp4"));
        let i = identify(&b27);
        assert_eq!(
            (i.model, i.weights),
            (Some(Model::Qwen3_8_27b), WeightFormat::Nvfp4)
        );
        assert_eq!(
            i.reason,
            "model_type \"qwen3_5\" with NVFP4 weights: Qwen3.8-27B NVFP4 (qwen3.8-27b-nvfp4)"
        );
        let flash = cfg(json!({"model_type": "qwen4_exp", "quantization_config": nvfp4}));
        assert_eq!(id_of(&flash), Some("qwen3.8-flash-next-nvfp4"));

        // ModelOpt mixed precision: NVFP4 named per layer in hf_quant_config.json only.
        let mixed = FolderFacts {
            config: Some(json!({"model_type": "qwen4_exp_text"})),
            hf_quant_config: Some(json!({"quantization": {"quant_algo": "MIXED_PRECISION",
                "quantized_layers": {"model.layers.0.mlp.experts.0.up_proj": {"quant_algo": "NVFP4"}}}})),
            gguf_files: vec![],
        };
        assert_eq!(id_of(&mixed), Some("qwen3.8-flash-next-nvfp4"));

        // GGUF: the 27B as a lone GGUF file, Flash-Next with GGUF experts beside config.json.
        let gsq3 = FolderFacts {
            gguf_files: vec![gguf(Some("qwen35"))],
            ..Default::default()
        };
        assert_eq!(id_of(&gsq3), Some("qwen3.8-27b-gsq3"));
        assert_eq!(
            identify(&gsq3).reason,
            "GGUF architecture \"qwen35\" with GGUF weights: Qwen3.8-27B 3-bit (GSQ-RCO) (qwen3.8-27b-gsq3)"
        );
        let g64 = FolderFacts {
            config: Some(json!({"model_type": "qwen4_exp", "quantization_config": nvfp4})),
            gguf_files: vec![gguf(None)],
            ..Default::default()
        };
        assert_eq!(id_of(&g64), Some("qwen3.8-flash-next-64g"));
        let g64_arch_only = FolderFacts {
            gguf_files: vec![gguf(Some("qwen4_exp"))],
            ..Default::default()
        };
        assert_eq!(id_of(&g64_arch_only), Some("qwen3.8-flash-next-64g"));
    }

    #[test]
    fn compressed_tensors_nvfp4_is_nvfp4() {
        let f = cfg(json!({"model_type": "qwen3_5", "quantization_config":
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}));
        assert_eq!(id_of(&f), Some("qwen3.8-27b-nvfp4"));
    }

    #[test]
    fn demo_tiny_unquantised_and_unknown_models_have_no_configuration() {
        // The demo says so in its config, even were it quantised.
        let demo = cfg(
            json!({"model_type": "qwen3_5_text", "capy_demo": {"version": 1},
                              "quantization_config": {"quant_algo": "NVFP4"}}),
        );
        let i = identify(&demo);
        assert_eq!(i.configuration, None);
        assert!(i.reason.contains("demo"), "{}", i.reason);
        // A tiny or BF16 checkpoint of a supported model.
        let bf16 = cfg(json!({"model_type": "qwen3_5_text", "torch_dtype": "bfloat16"}));
        let i = identify(&bf16);
        assert_eq!(
            (i.model, i.weights, i.configuration),
            (Some(Model::Qwen3_8_27b), WeightFormat::Other, None)
        );
        assert_eq!(
            i.reason,
            "model_type \"qwen3_5_text\" with unquantised or unlisted weights: not in the configuration table"
        );
        // FP8 only is not a configuration of the table.
        let fp8 =
            cfg(json!({"model_type": "qwen4_exp", "quantization_config": {"quant_method": "fp8"}}));
        assert_eq!(id_of(&fp8), None);
        // Another model entirely, quantised or not.
        let llama =
            cfg(json!({"model_type": "llama", "quantization_config": {"quant_algo": "NVFP4"}}));
        assert_eq!(identify(&llama).model, None);
        assert_eq!(id_of(&llama), None);
        let other_gguf = FolderFacts {
            gguf_files: vec![gguf(Some("llama"))],
            ..Default::default()
        };
        assert_eq!(id_of(&other_gguf), None);
        assert_eq!(identify(&FolderFacts::default()).configuration, None);
    }

    #[test]
    fn wrapper_type_falls_back_to_text_config() {
        let f = cfg(
            json!({"model_type": "some_wrapper", "text_config": {"model_type": "qwen4_exp_text"},
                           "quantization_config": {"quant_algo": "NVFP4"}}),
        );
        assert_eq!(id_of(&f), Some("qwen3.8-flash-next-nvfp4"));
    }

    #[test]
    fn read_folder_reads_json_and_lists_gguf_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "qwen3_5"}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("b.gguf"), b"").unwrap();
        std::fs::write(dir.path().join("a.GGUF"), b"").unwrap();
        std::fs::write(dir.path().join("notes.txt"), b"").unwrap();
        let facts = read_folder(dir.path(), |p| {
            Some(format!(
                "arch-of-{}",
                p.file_name().unwrap().to_string_lossy()
            ))
        })
        .unwrap();
        assert_eq!(facts.config, Some(json!({"model_type": "qwen3_5"})));
        assert_eq!(facts.hf_quant_config, None);
        let names: Vec<(&str, Option<&str>)> = facts
            .gguf_files
            .iter()
            .map(|g| (g.file_name.as_str(), g.architecture.as_deref()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("a.GGUF", Some("arch-of-a.GGUF")),
                ("b.gguf", Some("arch-of-b.gguf"))
            ]
        );

        std::fs::write(dir.path().join("hf_quant_config.json"), "{not json").unwrap();
        let err = read_folder(dir.path(), |_| None).unwrap_err();
        assert!(
            err.contains("hf_quant_config.json is not valid JSON"),
            "{err}"
        );
        let err = read_folder(&dir.path().join("missing"), |_| None).unwrap_err();
        assert!(err.contains("is not a folder"), "{err}");
    }
}
