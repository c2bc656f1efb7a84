//! Chat templates: the checkpoint's Jinja template rendered with minijinja, byte-identical to
//! transformers' `apply_chat_template(..., tokenize=False)`.
//!
//! transformers renders with Jinja2's `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)` plus `loopcontrols`, a `tojson` filter that is Python's
//! `json.dumps(x, ensure_ascii=False)` (default separators `", "` / `": "`, key order kept, no
//! HTML escaping), and the globals `raise_exception` and `strftime_now`. This module sets
//! minijinja up the same way and adds what Jinja2 has and minijinja lacks: Python string and
//! dict methods (minijinja-contrib's pycompat), Python's printing of `None`/`True`/`False` and
//! Python's `str()` for the `string` filter, and Jinja2's wider `sequence` test.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, Value};
use serde_json::{Map, Value as Json};

use crate::tokenizer::Tokenizer;

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Where the template came from, for error messages.
    origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// What a template is rendered with; the fields transformers passes to the template.
#[derive(Default, Clone, Debug)]
pub struct ChatTemplateInput {
    /// OpenAI-style `{role, content, reasoning_content?, tool_calls?, tool_call_id?, name?}`.
    pub messages: Vec<Json>,
    /// OpenAI-style `{"type": "function", "function": {name, description, parameters}}`.
    pub tools: Option<Vec<Json>>,
    pub add_generation_prompt: bool,
    /// Passed to the template only when set (Qwen templates test `enable_thinking is defined`).
    pub enable_thinking: Option<bool>,
    /// Other `chat_template_kwargs` (e.g. `preserve_thinking`), passed as template variables.
    pub extra: Map<String, Json>,
}

impl ChatTemplate {
    /// Compiles a template source; `bos_token`/`eos_token` become the template variables of the
    /// same names when given.
    pub fn from_source(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        Self::compile(source, bos_token, eos_token, "chat template".to_owned())
    }

    /// The template of a checkpoint folder: `chat_template.jinja` if present, else
    /// `chat_template.json`'s or `tokenizer_config.json`'s `"chat_template"` (a string, or a list
    /// of `{name, template}` of which the one named "default" is used, else the first). Special
    /// tokens come from `tokenizer_config.json`. `Ok(None)` when the folder has no template.
    pub fn from_checkpoint_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            Some(read_json(&config_path)?)
        } else {
            None
        };
        let token = |key: &str| config.as_ref().and_then(|c| special_token(c, key));
        let (bos, eos) = (token("bos_token"), token("eos_token"));

        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.is_file() {
            let source = std::fs::read_to_string(&jinja_path)
                .with_context(|| format!("cannot read {}", jinja_path.display()))?;
            return Self::compile(&source, bos, eos, jinja_path.display().to_string()).map(Some);
        }
        let json_path = dir.join("chat_template.json");
        if json_path.is_file() {
            let doc = read_json(&json_path)?;
            if let Some(source) = template_from_config(&doc, &json_path)? {
                let origin = format!("{} (\"chat_template\")", json_path.display());
                return Self::compile(&source, bos, eos, origin).map(Some);
            }
        }
        if let Some(doc) = &config {
            if let Some(source) = template_from_config(doc, &config_path)? {
                let origin = format!("{} (\"chat_template\")", config_path.display());
                return Self::compile(&source, bos, eos, origin).map(Some);
            }
        }
        Ok(None)
    }

    /// Renders the conversation to the prompt text.
    pub fn render(&self, input: &ChatTemplateInput) -> Result<String> {
        let mut ctx = Map::new();
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Json::String(bos.clone()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Json::String(eos.clone()));
        }
        // As in transformers: chat_template_kwargs override special tokens, and the named
        // arguments come last.
        for (key, value) in &input.extra {
            ctx.insert(key.clone(), value.clone());
        }
        if let Some(enable_thinking) = input.enable_thinking {
            ctx.insert("enable_thinking".into(), Json::Bool(enable_thinking));
        }
        ctx.insert("messages".into(), Json::Array(input.messages.clone()));
        ctx.insert(
            "tools".into(),
            input.tools.clone().map_or(Json::Null, Json::Array),
        );
        ctx.insert("documents".into(), Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(input.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the template was added at construction");
        template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| anyhow!("cannot render the {}: {}", self.origin, describe(&e)))
    }

    fn compile(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
        origin: String,
    ) -> Result<Self> {
        let mut env = Environment::new();
        // Jinja2 as transformers configures it.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_filter("string", python_str_filter);
        env.add_test("sequence", is_sequence);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| {
                anyhow!(
                    "the {origin} is not a valid Jinja template: {}",
                    describe(&e)
                )
            })?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
            origin,
        })
    }
}

/// Both files of a checkpoint folder: `tokenizer.json` (required) and the chat template
/// (optional, see [`ChatTemplate::from_checkpoint_dir`]).
pub fn load_tokenizer_and_template(dir: &Path) -> Result<(Tokenizer, Option<ChatTemplate>)> {
    // A GGUF file (`--model FILE.gguf`): the tokenizer files sit beside it.
    if dir.is_file()
        && dir
            .extension()
            .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
    {
        let parent = dir.parent().unwrap_or(Path::new("."));
        if !parent.join("tokenizer.json").is_file() {
            bail!(
                "{} is a GGUF file and its tokenizer is not read from the GGUF metadata: put the \
                 Hugging Face tokenizer.json (and tokenizer_config.json for the chat template) \
                 of its model beside it in {}",
                dir.display(),
                parent.display()
            );
        }
        return load_tokenizer_and_template(parent);
    }
    if !dir.is_dir() {
        bail!(
            "model folder {} does not exist or is not a folder",
            dir.display()
        );
    }
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        bail!(
            "{} is missing: the model folder {} needs the Hugging Face tokenizer.json of its \
             checkpoint (download it with the weights)",
            tokenizer_path.display(),
            dir.display()
        );
    }
    let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
    let template = ChatTemplate::from_checkpoint_dir(dir)?;
    Ok((tokenizer, template))
}

fn read_json(path: &PathBuf) -> Result<Json> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// `bos_token`/`eos_token` in tokenizer_config.json: a string or an AddedToken object.
fn special_token(config: &Json, key: &str) -> Option<String> {
    match config.get(key)? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn template_from_config(doc: &Json, path: &Path) -> Result<Option<String>> {
    match doc.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some(name))
            };
            let chosen = named("default").or(list.first());
            match chosen
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
            {
                Some(s) => Ok(Some(s.to_owned())),
                None => bail!(
                    "{}: \"chat_template\" is a list but has no {{\"name\", \"template\"}} entry \
                     with a string template",
                    path.display()
                ),
            }
        }
        Some(other) => bail!(
            "{}: \"chat_template\" should be a string or a list of {{name, template}}, found {}",
            path.display(),
            json_kind(other)
        ),
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// An error with its line and the chain of causes (minijinja keeps the cause of a failed
/// filter or function separately).
fn describe(err: &Error) -> String {
    let mut text = String::new();
    match err.kind() {
        ErrorKind::InvalidOperation if err.detail().is_some() => {
            text.push_str(err.detail().unwrap_or_default())
        }
        _ => text.push_str(&err.to_string()),
    }
    if let Some(line) = err.line() {
        if !text.contains("line ") {
            let _ = write!(text, " (line {line})");
        }
    }
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

/// Jinja2 prints Python values: `None`, `True`, `False`.
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// The `string` filter: Python's `str()`.
fn python_str_filter(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        return value.clone();
    }
    let mut text = String::new();
    python_str(value, &mut text, true);
    Value::from(text)
}

/// Python `str()` (top level) / `repr()` (nested) of a template value.
fn python_str(value: &Value, out: &mut String, top: bool) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            if top {
                out.push_str(s)
            } else {
                python_repr_str(s, out)
            }
        }
        ValueKind::Number => match serde_json::to_value(value) {
            Ok(Json::Number(n)) if n.is_f64() => {
                out.push_str(&python_float_repr(n.as_f64().unwrap_or(f64::NAN)))
            }
            _ => out.push_str(&value.to_string()),
        },
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_str(&item, out, false);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_str(&key, out, false);
                    out.push_str(": ");
                    let item = value.get_item(&key).unwrap_or_default();
                    python_str(&item, out, false);
                }
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

fn python_repr_str(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c)
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr(float)`: shortest round-trip digits, scientific notation when the decimal
/// exponent is below -4 or at least 16.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{x:e}"); // e.g. "-1.5e-7", "2e0": shortest round-trip digits
    let (mantissa, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let int_len = exp as usize + 1;
    if digits.len() <= int_len {
        let zeros = "0".repeat(int_len - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        let (int_part, frac) = digits.split_at(int_len);
        format!("{sign}{int_part}.{frac}")
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`; the options may be given by position or by name.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let positional = |i: usize| args.get(i).cloned();
    let option = |name: &str, i: usize| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named.or_else(|| positional(i)))
    };
    if args.len() > 4 {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments: ensure_ascii, indent, separators, sort_keys",
        ));
    }
    let ensure_ascii = option("ensure_ascii", 0)?.is_some_and(|v| v.is_true());
    let indent = match option("indent", 1)? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(v) => {
            let n = i64::try_from(v).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer, a string or None",
                )
            })?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let separators = match option("separators", 2)? {
        Some(v) if !v.is_none() => {
            let items: Vec<Value> = v.try_iter()?.collect();
            match items.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => Some((
                    item.as_str().unwrap_or_default().to_owned(),
                    key.as_str().unwrap_or_default().to_owned(),
                )),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings (item, key)",
                    ))
                }
            }
        }
        _ => None,
    };
    let sort_keys = option("sort_keys", 3)?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;

    if value.is_undefined() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "Object of type Undefined is not JSON serializable",
        ));
    }
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value is not JSON serializable",
        )
        .with_source(e)
    })?;
    let (item_sep, key_sep) = separators.unwrap_or_else(|| {
        // Python's defaults: ", " without indent, "," with it.
        let item = if indent.is_some() { "," } else { ", " };
        (item.to_owned(), ": ".to_owned())
    });
    let dumper = PyJsonDumper {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    dumper.write(&json, 0, &mut out);
    Ok(Value::from(out))
}

/// Python's `json.dumps` layout.
struct PyJsonDumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl PyJsonDumper {
    fn write(&self, value: &Json, depth: usize, out: &mut String) {
        match value {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => match n.as_f64() {
                Some(f) if n.is_f64() => out.push_str(&python_float_repr(f)),
                _ => out.push_str(&n.to_string()),
            },
            Json::String(s) => self.write_str(s, out),
            Json::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            Json::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write_str(key, out);
                    out.push_str(&self.key_sep);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Jinja2's `sequence` test: anything with a length and item access (strings, lists, dicts).
fn is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Seq | ValueKind::String | ValueKind::Map
    )
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `strftime_now(format)`: the current time formatted with C `strftime` codes.
/// The time is UTC (transformers uses the local time zone; servers usually run in UTC).
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "system clock is before 1970"))?;
    Ok(Value::from(strftime(&format, now.as_secs() as i64)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `strftime` of a UTC Unix time, for the codes chat templates use.
fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (
        secs_of_day / 3600,
        (secs_of_day / 60) % 60,
        secs_of_day % 60,
    );
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:>2}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{hour12:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('j') => write!(out, "{day_of_year:03}"),
            Some('B') => write!(out, "{}", MONTHS[month as usize - 1]),
            Some('b') | Some('h') => write!(out, "{}", &MONTHS[month as usize - 1][..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('u') => write!(out, "{}", weekday + 1),
            Some('w') => write!(out, "{}", (weekday + 1) % 7),
            Some('F') => write!(out, "{year}-{month:02}-{day:02}"),
            Some('T') => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            Some('Z') => write!(out, "UTC"),
            Some('z') => write!(out, "+0000"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, extra: Json) -> Result<String> {
        let template = ChatTemplate::from_source(source, None, Some("<|im_end|>".into()))?;
        let input = ChatTemplateInput {
            messages: vec![json!({"role": "user", "content": "hi"})],
            extra: extra.as_object().cloned().unwrap_or_default(),
            ..Default::default()
        };
        template.render(&input)
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let out = render(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(sort_keys=true) }}",
            json!({"x": {"b": [1, 2.5, 1e-7, 1e16, 100.0], "a": "é<&>'\"\n", "c": null, "d": true, "e": {}}}),
        )
        .unwrap();
        let compact = r#"{"b": [1, 2.5, 1e-07, 1e+16, 100.0], "a": "é<&>'\"\n", "c": null, "d": true, "e": {}}"#;
        let indented = "{\n  \"b\": [\n    1,\n    2.5,\n    1e-07,\n    1e+16,\n    100.0\n  ],\n  \"a\": \"é<&>'\\\"\\n\",\n  \"c\": null,\n  \"d\": true,\n  \"e\": {}\n}";
        let sorted = r#"{"a": "é<&>'\"\n", "b": [1, 2.5, 1e-07, 1e+16, 100.0], "c": null, "d": true, "e": {}}"#;
        assert_eq!(out, format!("{compact}|{indented}|{sorted}"));
    }

    #[test]
    fn python_float_repr_cases() {
        for (x, expected) in [
            (0.0, "0.0"),
            (-0.5, "-0.5"),
            (1e-4, "0.0001"),
            (1.5e-5, "1.5e-05"),
            (123456789.125, "123456789.125"),
            (1e15, "1000000000000000.0"),
            (1.25e16, "1.25e+16"),
            (0.1 + 0.2, "0.30000000000000004"),
        ] {
            assert_eq!(python_float_repr(x), expected, "{x}");
        }
    }

    #[test]
    fn python_printing_and_string_filter() {
        let out = render(
            "{{ n }} {{ t }} {{ f }} {{ n | string }} {{ d | string }} {{ 3 | string }}",
            json!({"n": null, "t": true, "f": false, "d": {"k": ["it's", 1.0, null]}}),
        )
        .unwrap();
        assert_eq!(out, "None True False None {'k': [\"it's\", 1.0, None]} 3");
    }

    #[test]
    fn jinja2_tests_and_python_methods() {
        let out = render(
            "{{ 'ab' is sequence }} {{ {} is sequence }} {{ 1 is sequence }} {{ 'ab' is string }} \
             {{ {} is mapping }} {{ 'a,b,c'.split(',') | length }} {{ '  x\n'.rstrip() }}|{{ 'xyx'.strip('x') }} \
             {{ 'abc'.startswith('ab') }} {{ 'a-b'.replace('-', '+') }} {% for k, v in {'z': 1, 'a': 2}.items() %}{{ k }}{{ v }}{% endfor %}",
            json!({}),
        )
        .unwrap();
        assert_eq!(out, "True True False True True 3   x|y True a+b z1a2");
    }

    #[test]
    fn trim_and_lstrip_blocks_and_loop_controls() {
        let source = "{% for m in messages %}\n    {% if loop.first %}\n[{{ m.content }}]\n    {% endif %}\n{% break %}\n{% endfor %}\n";
        assert_eq!(render(source, json!({})).unwrap(), "[hi]\n");
    }

    #[test]
    fn namespace_and_previtem() {
        let source = "{% set ns = namespace(n=0) %}{% for x in [1, 2, 3] %}{% set ns.n = ns.n + x %}{% if loop.previtem %}<{{ loop.previtem }}>{% endif %}{% endfor %}{{ ns.n }}";
        assert_eq!(render(source, json!({})).unwrap(), "<1><2>6");
    }

    #[test]
    fn raise_exception_message_reaches_the_error() {
        let err = render("{{ raise_exception('No user query found.') }}", json!({})).unwrap_err();
        assert!(err.to_string().contains("No user query found."), "{err}");
    }

    #[test]
    fn syntax_error_is_reported_with_its_origin() {
        let err = ChatTemplate::from_source("{% if x %}unclosed", None, None).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("chat template") && text.contains("not a valid Jinja"),
            "{text}"
        );
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC was a Thursday.
        let t = days_from_civil(2024, 2, 29) * 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %d %j %I%p %y %%", t),
            "2024-02-29 13:05:09 Thu Thursday Feb February 29 060 01PM 24 %"
        );
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(strftime("%A", 0), "Thursday");
    }

    #[test]
    fn strftime_now_renders_this_year() {
        let out = render("{{ strftime_now('%Y') }}", json!({})).unwrap();
        let year: i64 = out.parse().unwrap();
        assert!((2024..3000).contains(&year), "{out}");
    }

    #[test]
    fn enable_thinking_is_undefined_unless_set() {
        let source = "{{ enable_thinking is defined }}";
        let template = ChatTemplate::from_source(source, None, None).unwrap();
        let mut input = ChatTemplateInput::default();
        assert_eq!(template.render(&input).unwrap(), "False");
        input.enable_thinking = Some(false);
        assert_eq!(template.render(&input).unwrap(), "True");
    }
}
