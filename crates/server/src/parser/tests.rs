use super::*;
use serde_json::json;

/// Aggregated parse: (reasoning, text, [(name, arguments JSON)]), checking that the argument
/// fragments concatenate to the final arguments.
fn parse_in_pieces(
    config: ParserConfig,
    text: &str,
    piece_chars: usize,
) -> (String, String, Vec<(String, Value)>) {
    let mut p = OutputParser::new(config);
    let chars: Vec<char> = text.chars().collect();
    let mut events = Vec::new();
    for chunk in chars.chunks(piece_chars.max(1)) {
        events.extend(p.push(&chunk.iter().collect::<String>()));
    }
    events.extend(p.finish());
    let (mut reasoning, mut answer, mut calls) = (String::new(), String::new(), Vec::new());
    let mut fragments: HashMap<usize, String> = HashMap::new();
    for e in events {
        match e {
            ParsedEvent::Reasoning(t) => reasoning.push_str(&t),
            ParsedEvent::Text(t) => answer.push_str(&t),
            ParsedEvent::ToolCallBegin { index, name, .. } => {
                assert_eq!(index, calls.len());
                calls.push((name, Value::Null));
            }
            ParsedEvent::ToolCallArguments { index, delta } => {
                fragments.entry(index).or_default().push_str(&delta)
            }
            ParsedEvent::ToolCallEnd { index, arguments } => {
                assert_eq!(
                    fragments.get(&index).map(String::as_str),
                    Some(arguments.as_str())
                );
                calls[index].1 =
                    serde_json::from_str(&arguments).expect("arguments are valid JSON");
            }
        }
    }
    (reasoning, answer, calls)
}

/// The same output parsed whole, in 1-char pieces and in 3-char pieces must agree.
fn parse(config: ParserConfig, text: &str) -> (String, String, Vec<(String, Value)>) {
    let whole = parse_in_pieces(config.clone(), text, usize::MAX);
    assert_eq!(
        parse_in_pieces(config.clone(), text, 1),
        whole,
        "1-char pieces differ"
    );
    assert_eq!(
        parse_in_pieces(config, text, 3),
        whole,
        "3-char pieces differ"
    );
    whole
}

fn tools_config() -> ParserConfig {
    let mut tool_parameters = HashMap::new();
    tool_parameters.insert(
        "get_weather".to_string(),
        json!({"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}),
    );
    ParserConfig {
        parse_tool_calls: true,
        tool_parameters,
        ..Default::default()
    }
}

#[test]
fn reasoning_then_answer() {
    let cfg = ParserConfig {
        start_in_reasoning: true,
        ..Default::default()
    };
    let (r, t, c) = parse(cfg, "\nLet me think.\n</think>\n\nThe answer is 4.");
    assert_eq!(r, "Let me think.");
    assert_eq!(t, "The answer is 4.");
    assert!(c.is_empty());
}

#[test]
fn model_opened_reasoning_itself() {
    let (r, t, _) = parse(ParserConfig::default(), "<think>hmm</think>ok");
    assert_eq!((r.as_str(), t.as_str()), ("hmm", "ok"));
}

#[test]
fn unclosed_reasoning_at_end_stays_reasoning() {
    let cfg = ParserConfig {
        start_in_reasoning: true,
        ..Default::default()
    };
    let (r, t, _) = parse(cfg, "still thinking </thi");
    assert_eq!(r, "still thinking </thi");
    assert_eq!(t, "");
}

#[test]
fn plain_text_with_angle_brackets_is_untouched() {
    let (_, t, c) = parse(tools_config(), "a < b and <tool> is not <tool_cal a call");
    assert_eq!(t, "a < b and <tool> is not <tool_cal a call");
    assert!(c.is_empty());
}

#[test]
fn xml_tool_call_with_typed_parameters() {
    let out = "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>";
    let (_, t, c) = parse(tools_config(), out);
    assert_eq!(t, "I'll check.\n\n");
    assert_eq!(
        c,
        vec![(
            "get_weather".to_string(),
            json!({"city": "Paris", "days": 3, "metric": true})
        )]
    );
}

#[test]
fn parallel_xml_calls_and_untyped_values() {
    let out = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nrust \"axum\"\n</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{'lang': None}\n</parameter>\n</function>\n</tool_call>";
    let (_, t, c) = parse(tools_config(), out);
    assert_eq!(t, "");
    assert_eq!(
        c,
        vec![
            ("get_weather".to_string(), json!({"city": "42"})),
            (
                "search".to_string(),
                json!({"query": "rust \"axum\"", "limit": 5, "filters": {"lang": null}})
            ),
        ]
    );
}

#[test]
fn json_tool_call_form_with_python_literals() {
    let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"metric\": False}}\n</tool_call>";
    let (_, _, c) = parse(tools_config(), out);
    assert_eq!(
        c,
        vec![(
            "get_weather".to_string(),
            json!({"city": "Oslo", "metric": false})
        )]
    );
}

#[test]
fn unclosed_xml_call_at_end_is_closed() {
    let out = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</param";
    let (_, _, c) = parse(tools_config(), out);
    assert_eq!(
        c,
        vec![("get_weather".to_string(), json!({"city": "Rome"}))]
    );
    let (_, _, c) = parse(
        tools_config(),
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n",
    );
    assert_eq!(c, vec![("get_weather".to_string(), json!({"days": 2}))]);
}

#[test]
fn unclosed_json_call_at_end_is_repaired() {
    let (_, _, c) = parse(
        tools_config(),
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, 2",
    );
    assert_eq!(c, vec![("f".to_string(), json!({"a": [1, 2]}))]);
}

#[test]
fn reasoning_then_tool_call() {
    let cfg = ParserConfig {
        start_in_reasoning: true,
        ..tools_config()
    };
    let out = "need weather</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>";
    let (r, t, c) = parse(cfg, out);
    assert_eq!((r.as_str(), t.as_str()), ("need weather", ""));
    assert_eq!(c[0].1, json!({"city": "Lima"}));
}

#[test]
fn tool_calls_are_text_when_parsing_is_off() {
    let out = "<tool_call>\n<function=f>\n</function>\n</tool_call>";
    let (_, t, c) = parse(ParserConfig::default(), out);
    assert_eq!(t, out);
    assert!(c.is_empty());
}

#[test]
fn prefilled_call_starts_inside_the_function() {
    let cfg = ParserConfig {
        prefilled_call: Some("<tool_call>\n<function=get_weather>\n".into()),
        ..tools_config()
    };
    let (_, _, c) = parse(
        cfg,
        "<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>",
    );
    assert_eq!(
        c,
        vec![("get_weather".to_string(), json!({"city": "Bern"}))]
    );
}

#[test]
fn garbage_inside_tool_call_is_kept_as_text() {
    let (_, t, c) = parse(tools_config(), "<tool_call>just words</tool_call>");
    assert!(c.is_empty());
    assert_eq!(t, "<tool_call>just words</tool_call>");
}
