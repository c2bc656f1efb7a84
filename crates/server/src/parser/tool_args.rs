//! Turning the model's tool-call arguments into valid JSON, tolerant of small drift.

use serde_json::{Map, Value};

/// The JSON type a tool's schema gives a parameter, when it gives one.
pub fn schema_type(schema: Option<&Value>) -> Option<&str> {
    let t = schema?.get("type")?;
    match t {
        Value::String(s) => Some(s.as_str()),
        // ["string", "null"] and the like: the first non-null type decides.
        Value::Array(a) => a.iter().filter_map(|v| v.as_str()).find(|s| *s != "null"),
        _ => None,
    }
}

/// Converts one XML `<parameter>` value (raw text) to JSON, following the schema's type:
/// strings stay strings; other types are parsed (Python `True`/`None` accepted) and fall back
/// to the raw string when that fails, so the arguments are always valid JSON.
pub fn parameter_value(raw: &str, schema_type: Option<&str>) -> Value {
    let text = raw.strip_prefix('\n').unwrap_or(raw);
    let text = text.strip_suffix('\n').unwrap_or(text);
    if schema_type == Some("string") {
        return Value::String(text.to_string());
    }
    let trimmed = text.trim();
    match parse_lenient(trimmed) {
        Some(v) if schema_type.is_some() || !v.is_string() => match (schema_type, &v) {
            (Some("integer") | Some("number"), Value::Number(_)) => v,
            (Some("boolean"), Value::Bool(_)) => v,
            (Some("object"), Value::Object(_)) | (Some("array"), Value::Array(_)) => v,
            (Some("null"), Value::Null) => v,
            (None, _) => v,
            _ => Value::String(text.to_string()),
        },
        _ => Value::String(text.to_string()),
    }
}

/// Parses JSON, accepting Python literals (`True`, `False`, `None`), single-quoted strings and
/// missing closing brackets at the end (a generation cut short).
pub fn parse_lenient(text: &str) -> Option<Value> {
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        return Some(v);
    }
    let fixed = pythonish_to_json(text);
    if let Ok(v) = serde_json::from_str::<Value>(&fixed) {
        return Some(v);
    }
    serde_json::from_str::<Value>(&close_open_brackets(&fixed)).ok()
}

/// Rewrites Python literals and single-quoted strings into JSON, leaving string contents alone.
fn pythonish_to_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' {
            // Copy a string, converting single quotes to double quotes.
            let quote = c;
            out.push('"');
            i += 1;
            while i < chars.len() && chars[i] != quote {
                if chars[i] == '\\' && i + 1 < chars.len() {
                    if quote == '\'' && chars[i + 1] == '\'' {
                        out.push('\'');
                    } else {
                        out.push('\\');
                        out.push(chars[i + 1]);
                    }
                    i += 2;
                    continue;
                }
                if quote == '\'' && chars[i] == '"' {
                    out.push_str("\\\"");
                } else {
                    out.push(chars[i]);
                }
                i += 1;
            }
            if i < chars.len() {
                out.push('"');
            }
            i += 1;
            continue;
        }
        if c.is_alphabetic() {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            out.push_str(match word.as_str() {
                "True" => "true",
                "False" => "false",
                "None" => "null",
                w => w,
            });
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// Appends the closers of brackets (and a string) left open at the end.
fn close_open_brackets(text: &str) -> String {
    let mut stack = Vec::new();
    let mut in_string = false;
    let mut escaped = false;
    for c in text.chars() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => stack.push('}'),
            '[' => stack.push(']'),
            '}' | ']' => {
                stack.pop();
            }
            _ => {}
        }
    }
    let mut out = text.trim_end().trim_end_matches(',').to_string();
    if in_string {
        out.push('"');
    }
    while let Some(c) = stack.pop() {
        out.push(c);
    }
    out
}

/// Reads the JSON tool-call form `{"name": ..., "arguments": {...}}` (or `"parameters"`);
/// returns the name and the arguments as a JSON object text.
pub fn json_tool_call(body: &str) -> Option<(String, String)> {
    let v = parse_lenient(body.trim())?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) => parse_lenient(s)
            .filter(|v| v.is_object())
            .unwrap_or(Value::Object(Map::new())),
        Some(v) => v.clone(),
    };
    Some((name, args.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parameter_values_follow_the_schema_type() {
        assert_eq!(parameter_value("\n42\n", Some("integer")), json!(42));
        assert_eq!(parameter_value("\n42\n", Some("string")), json!("42"));
        assert_eq!(parameter_value("True", Some("boolean")), json!(true));
        assert_eq!(
            parameter_value("\n{'a': None}\n", Some("object")),
            json!({"a": null})
        );
        assert_eq!(
            parameter_value("\nnot a number\n", Some("integer")),
            json!("not a number")
        );
        assert_eq!(
            parameter_value("\nline one\nline two\n", None),
            json!("line one\nline two")
        );
        assert_eq!(parameter_value("[1, 2]", None), json!([1, 2]));
    }

    #[test]
    fn lenient_json_accepts_python_and_truncation() {
        assert_eq!(
            parse_lenient("{'x': True, 'y': [None, False]}"),
            Some(json!({"x": true, "y": [null, false]}))
        );
        assert_eq!(
            parse_lenient(r#"{"a": "it's \"ok\"", "b": [1, 2"#),
            Some(json!({"a": "it's \"ok\"", "b": [1, 2]}))
        );
        assert_eq!(
            parse_lenient(r#"{"text": "True story"}"#),
            Some(json!({"text": "True story"}))
        );
        assert_eq!(parse_lenient("nonsense {"), None);
    }

    #[test]
    fn json_tool_call_forms() {
        let (n, a) = json_tool_call(r#"{"name": "f", "arguments": {"q": True}}"#).unwrap();
        assert_eq!(
            (n.as_str(), serde_json::from_str::<Value>(&a).unwrap()),
            ("f", json!({"q": true}))
        );
        let (_, a) = json_tool_call(r#"{"name": "f", "arguments": "{\"q\": 1}"}"#).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&a).unwrap(), json!({"q": 1}));
        let (_, a) = json_tool_call(r#"{"name": "g"}"#).unwrap();
        assert_eq!(a, "{}");
        assert!(json_tool_call(r#"{"arguments": {}}"#).is_none());
    }
}
