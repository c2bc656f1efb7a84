//! Capy Flash HTTP server: one axum router, one adapter per API (OpenAI chat completions, OpenAI Responses, Anthropic Messages) over a shared scheduler.
