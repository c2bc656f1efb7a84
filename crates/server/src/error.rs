//! Errors in each API's own JSON shape and status code.

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use capy_engine::scheduler::SubmitError;
use serde_json::json;

/// Which API's error shape to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `{"error": {"message", "type", "param", "code"}}`
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`
    Anthropic,
}

impl Flavor {
    /// The API a path belongs to (for errors raised before a handler runs).
    pub fn for_path(path: &str) -> Flavor {
        if path.starts_with("/v1/messages") {
            Flavor::Anthropic
        } else {
            Flavor::OpenAi
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    NotFound,
    MethodNotAllowed,
    TooLarge,
    Overloaded,
    ContextLength,
    Internal,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub flavor: Flavor,
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault (OpenAI's `param`).
    pub param: Option<String>,
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(flavor: Flavor, kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            flavor,
            kind,
            message: message.into(),
            param: None,
            retry_after_s: None,
        }
    }

    pub fn invalid(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(flavor, ErrorKind::InvalidRequest, message)
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn context_length(flavor: Flavor, prompt_tokens: usize, max_context: usize) -> Self {
        let message = match flavor {
            // Claude Code recognises this wording and offers to compact the conversation.
            Flavor::Anthropic => format!("prompt is too long: {prompt_tokens} tokens > {max_context} maximum"),
            Flavor::OpenAi => format!(
                "This model's maximum context length is {max_context} tokens. However, your messages resulted in {prompt_tokens} tokens. Please reduce the length of the messages."
            ),
        };
        Self::new(flavor, ErrorKind::ContextLength, message).with_param("messages")
    }

    pub fn from_submit(flavor: Flavor, e: SubmitError, retry_after_s: u64) -> Self {
        match e {
            SubmitError::ContextLength {
                prompt_tokens,
                max_context,
            } => Self::context_length(flavor, prompt_tokens, max_context),
            SubmitError::Overloaded { .. } => {
                let mut err = Self::new(flavor, ErrorKind::Overloaded, e.to_string());
                err.retry_after_s = Some(retry_after_s);
                err
            }
            SubmitError::Invalid(m) => Self::invalid(flavor, m),
            SubmitError::Stopped => Self::new(flavor, ErrorKind::Internal, e.to_string()),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::InvalidRequest | ErrorKind::ContextLength => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Overloaded => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `type` string of the error object.
    pub fn type_name(&self) -> &'static str {
        match (self.flavor, self.kind) {
            (
                Flavor::Anthropic,
                ErrorKind::InvalidRequest | ErrorKind::ContextLength | ErrorKind::MethodNotAllowed,
            ) => "invalid_request_error",
            (Flavor::Anthropic, ErrorKind::Authentication) => "authentication_error",
            (Flavor::Anthropic, ErrorKind::NotFound) => "not_found_error",
            (Flavor::Anthropic, ErrorKind::TooLarge) => "request_too_large",
            (Flavor::Anthropic, ErrorKind::Overloaded) => "rate_limit_error",
            (Flavor::Anthropic, ErrorKind::Internal) => "api_error",
            (Flavor::OpenAi, ErrorKind::Overloaded) => "rate_limit_error",
            (Flavor::OpenAi, ErrorKind::Internal) => "server_error",
            (Flavor::OpenAi, ErrorKind::Authentication) => "authentication_error",
            (Flavor::OpenAi, _) => "invalid_request_error",
        }
    }

    /// OpenAI's `code` (also used by Responses' `response.failed`).
    pub fn code(&self) -> Option<&'static str> {
        match self.kind {
            ErrorKind::ContextLength => Some("context_length_exceeded"),
            ErrorKind::Authentication => Some("invalid_api_key"),
            ErrorKind::Overloaded => Some("rate_limit_exceeded"),
            ErrorKind::TooLarge => Some("request_too_large"),
            ErrorKind::NotFound => Some("not_found"),
            ErrorKind::Internal => Some("server_error"),
            ErrorKind::InvalidRequest | ErrorKind::MethodNotAllowed => None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => {
                json!({"error": {"message": self.message, "type": self.type_name(), "param": self.param, "code": self.code()}})
            }
            Flavor::Anthropic => {
                json!({"type": "error", "error": {"type": self.type_name(), "message": self.message}})
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// Parses a request body, turning every failure into the API's own 400/413.
pub fn parse_body<T: serde::de::DeserializeOwned>(
    flavor: Flavor,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                flavor,
                ErrorKind::TooLarge,
                format!(
                    "the request body is larger than the server's limit: {}",
                    rej.body_text()
                ),
            )
        } else {
            ApiError::invalid(
                flavor,
                format!("cannot read the request body: {}", rej.body_text()),
            )
        }
    })?;
    if bytes.is_empty() {
        return Err(ApiError::invalid(
            flavor,
            "the request body is empty; expected a JSON object",
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid(flavor, format!("the request body is not valid JSON: {e}"))
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            flavor,
            "the request body must be a JSON object",
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::invalid(flavor, format!("invalid request: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_per_flavor() {
        let e = ApiError::context_length(Flavor::Anthropic, 10, 5);
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["type"], "error");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        assert!(e.body()["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt is too long"));
        let e = ApiError::context_length(Flavor::OpenAi, 10, 5);
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        let e = ApiError::from_submit(
            Flavor::OpenAi,
            SubmitError::Overloaded {
                queued: 1,
                limit: 1,
            },
            2,
        );
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.into_response().headers()[header::RETRY_AFTER], "2");
    }
}
