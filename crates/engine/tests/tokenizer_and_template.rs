//! The tokenizer and the chat templates against fixtures written by transformers and Python
//! `tokenizers` (tools/make_template_fixtures.py): identical ids, byte-identical renders.

use std::path::{Path, PathBuf};

use capy_engine::chat_template::{load_tokenizer_and_template, ChatTemplate, ChatTemplateInput};
use capy_engine::tokenizer::{demo_tokenizer_json, Tokenizer, DEMO_CHAT_TEMPLATE};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn demo_tokenizer() -> Tokenizer {
    Tokenizer::from_json_bytes(&demo_tokenizer_json()).expect("demo tokenizer loads")
}

fn corpus() -> Value {
    read_json(&fixtures().join("tokenizer/corpus.json"))
}

fn ids_of(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("ids are a list")
        .iter()
        .map(|v| v.as_u64().expect("id is an integer") as u32)
        .collect()
}

#[test]
fn encode_matches_python_tokenizers_on_the_corpus() {
    let tok = demo_tokenizer();
    let corpus = corpus();
    assert_eq!(
        tok.vocab_size() as u64,
        corpus["vocab_size"].as_u64().unwrap()
    );
    let lines = corpus["lines"].as_array().unwrap();
    assert!(lines.len() >= 15);
    for line in lines {
        let text = line["text"].as_str().unwrap();
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(ids, ids_of(&line["ids"]), "ids differ for {text:?}");
        // Qwen's post-processor adds no BOS/EOS.
        assert_eq!(tok.encode(text, true).unwrap(), ids, "{text:?}");
    }
}

#[test]
fn decode_matches_python_and_round_trips() {
    let tok = demo_tokenizer();
    for line in corpus()["lines"].as_array().unwrap() {
        let text = line["text"].as_str().unwrap();
        let ids = ids_of(&line["ids"]);
        let decoded = tok.decode(&ids, false).unwrap();
        assert_eq!(decoded, line["decoded"].as_str().unwrap(), "{text:?}");
        let skipped = tok.decode(&ids, true).unwrap();
        assert_eq!(
            skipped,
            line["decoded_skip_special"].as_str().unwrap(),
            "{text:?}"
        );
        // The normalizer is NFC, so the round trip gives the NFC form of the text; every corpus
        // line but the one with combining marks is already NFC.
        if text.contains('\u{0301}') {
            assert_ne!(decoded, text);
            assert!(decoded.contains('é'));
        } else {
            assert_eq!(decoded, text, "decode(encode(x)) != x");
        }
    }
}

#[test]
fn stream_decoder_concatenation_equals_decode() {
    let tok = demo_tokenizer();
    let mut saw_split_char = false;
    for skip_special in [false, true] {
        for line in corpus()["lines"].as_array().unwrap() {
            let ids = ids_of(&line["ids"]);
            let mut stream = tok.stream_decoder(skip_special);
            let mut out = String::new();
            for &id in &ids {
                let piece = stream.push(id).unwrap();
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "partial character emitted: {piece:?}"
                );
                saw_split_char |= piece.is_empty() && !tok.is_special(id);
                out.push_str(&piece);
            }
            out.push_str(&stream.finish().unwrap());
            assert_eq!(out, tok.decode(&ids, skip_special).unwrap());
        }
    }
    assert!(
        saw_split_char,
        "the corpus should have characters split across tokens"
    );
}

#[test]
fn special_tokens_in_text_become_their_ids() {
    let tok = demo_tokenizer();
    let specials = corpus()["special_ids"].clone();
    for (name, id) in specials.as_object().unwrap() {
        let id = id.as_u64().unwrap() as u32;
        assert_eq!(tok.token_to_id(name), Some(id), "{name}");
        assert_eq!(tok.id_to_token(id).as_deref(), Some(name.as_str()));
        assert_eq!(
            tok.encode(&format!("a{name}b"), false).unwrap()[1],
            id,
            "{name}"
        );
    }
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert!(tok.is_special(im_end));
    assert_eq!(tok.decode(&[im_end], true).unwrap(), "");
}

#[test]
fn demo_template_is_the_fixture_template() {
    let fixture = read_json(&fixtures().join("templates/qwen3_6.json"));
    assert_eq!(fixture["template"], "qwen3_6");
    assert!(DEMO_CHAT_TEMPLATE.contains("<function="));
}

fn check_template_fixture(name: &str, source: &str) {
    let fixture = read_json(&fixtures().join(format!("templates/{name}.json")));
    let template = ChatTemplate::from_source(
        source,
        fixture["bos_token"].as_str().map(str::to_owned),
        fixture["eos_token"].as_str().map(str::to_owned),
    )
    .unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 10, "{name}: too few cases");
    let mut rendered = 0;
    for case in cases {
        let case_name = case["name"].as_str().unwrap();
        let input = ChatTemplateInput {
            messages: case["messages"].as_array().unwrap().clone(),
            tools: case["tools"].as_array().cloned(),
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            enable_thinking: case["enable_thinking"].as_bool(),
            extra: case["extra"].as_object().cloned().unwrap_or_default(),
        };
        let result = template.render(&input);
        match (case.get("expected"), case.get("expected_error")) {
            (Some(expected), _) => {
                let got = result.unwrap_or_else(|e| panic!("{name}/{case_name}: {e:#}"));
                let expected = expected.as_str().unwrap();
                if got != expected {
                    let at = got
                        .bytes()
                        .zip(expected.bytes())
                        .position(|(a, b)| a != b)
                        .unwrap_or(got.len().min(expected.len()));
                    panic!(
                        "{name}/{case_name}: render differs at byte {at}\n--- got ---\n{got}\n--- expected ---\n{expected}"
                    );
                }
                rendered += 1;
            }
            (None, Some(error)) => {
                let err = match result {
                    Ok(text) => panic!("{name}/{case_name}: expected {error}, rendered {text:?}"),
                    Err(e) => format!("{e:#}"),
                };
                // Messages the template raises itself must come through verbatim.
                let error = error.as_str().unwrap();
                if let Some(message) = error.strip_prefix("TemplateError: ") {
                    assert!(err.contains(message), "{name}/{case_name}: {err}");
                }
            }
            _ => panic!("{name}/{case_name}: fixture has neither expected nor expected_error"),
        }
    }
    assert!(rendered >= 10, "{name}: only {rendered} cases rendered");
}

#[test]
fn qwen3_6_template_renders_like_transformers() {
    check_template_fixture("qwen3_6", DEMO_CHAT_TEMPLATE);
}

#[test]
fn qwen3_template_renders_like_transformers() {
    let source = std::fs::read_to_string(fixtures().join("templates/qwen3.jinja")).unwrap();
    check_template_fixture("qwen3", &source);
}

#[test]
fn checkpoint_folder_loading_and_template_sources() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), demo_tokenizer_json()).unwrap();
    let (tok, template) = load_tokenizer_and_template(dir.path()).unwrap();
    assert_eq!(tok.vocab_size(), demo_tokenizer().vocab_size());
    assert!(template.is_none());

    // tokenizer_config.json: a list of named templates, the "default" one wins; eos is an
    // AddedToken object.
    let config = serde_json::json!({
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ eos_token }}:{{ messages[0].content }}"}
        ]
    });
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    let input = ChatTemplateInput {
        messages: vec![serde_json::json!({"role": "user", "content": "hi"})],
        ..Default::default()
    };
    let template = ChatTemplate::from_checkpoint_dir(dir.path())
        .unwrap()
        .unwrap();
    assert_eq!(template.render(&input).unwrap(), "<|im_end|>:hi");

    // chat_template.jinja takes precedence.
    std::fs::write(dir.path().join("chat_template.jinja"), "J{{ eos_token }}").unwrap();
    let template = ChatTemplate::from_checkpoint_dir(dir.path())
        .unwrap()
        .unwrap();
    assert_eq!(template.render(&input).unwrap(), "J<|im_end|>");
}

#[test]
fn missing_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_tokenizer_and_template(dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("missing"),
        "{err}"
    );
    let err = load_tokenizer_and_template(&dir.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn malformed_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, b"{\"model\": {\"type\": \"BPE\", ").unwrap();
    let err = format!("{:#}", Tokenizer::from_file(&path).unwrap_err());
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(
        err.contains("not a valid Hugging Face tokenizer.json"),
        "{err}"
    );
}

#[test]
fn malformed_tokenizer_config_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{ not json").unwrap();
    let err = format!(
        "{:#}",
        ChatTemplate::from_checkpoint_dir(dir.path()).unwrap_err()
    );
    assert!(
        err.contains("tokenizer_config.json") && err.contains("not valid JSON"),
        "{err}"
    );
}

#[test]
fn template_syntax_error_names_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}\n{{ m.content }\n{% endfor %}",
    )
    .unwrap();
    let err = format!(
        "{:#}",
        ChatTemplate::from_checkpoint_dir(dir.path()).unwrap_err()
    );
    assert!(err.contains("chat_template.jinja"), "{err}");
    assert!(err.contains("line 2"), "{err}");
}

#[test]
fn render_error_names_the_template() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("chat_template.jinja"), DEMO_CHAT_TEMPLATE).unwrap();
    let template = ChatTemplate::from_checkpoint_dir(dir.path())
        .unwrap()
        .unwrap();
    let err = template
        .render(&ChatTemplateInput::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("chat_template.jinja"), "{err}");
    assert!(err.contains("No messages provided."), "{err}");
}
