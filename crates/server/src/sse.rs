//! Server-sent events: every streamed byte of every API is written here.
//!
//! An adapter turns [`OutputEvent`]s into its protocol's events; [`respond`] runs the
//! generation on a task, sends keep-alives while nothing else is sent (long prefills), and
//! stops (cancelling the generation) as soon as the client goes away.

use crate::generate::{Generation, OutputEvent};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::convert::Infallible;
use std::time::Duration;

pub trait StreamAdapter: Send + 'static {
    /// Events sent before the first token (`message_start`, `response.created`, the role delta).
    fn start(&mut self) -> Vec<Event>;
    /// Events for one generation event; after `Done`/`Failed`, the closing events.
    fn on_event(&mut self, event: OutputEvent) -> Vec<Event>;
    /// What to send when nothing happened for a keep-alive interval.
    fn keepalive(&mut self) -> Event;
    /// True when [`StreamAdapter::start`] reports the prompt tokens resumed from the prefix
    /// cache (Anthropic's `message_start` usage): the stream then starts once the request is
    /// admitted, when that count is known.
    fn wants_cached_tokens(&self) -> bool {
        false
    }
    /// The cached prompt tokens, before `start` (only called when wanted).
    fn set_cached_tokens(&mut self, _cached: usize) {}
}

/// `event: NAME` (when given) and `data: JSON`.
pub fn json_event(name: Option<&str>, data: &Value) -> Event {
    let e = Event::default().data(data.to_string());
    match name {
        Some(n) => e.event(n),
        None => e,
    }
}

/// An SSE comment line (`: keep-alive`), which every SSE client ignores.
pub fn comment(text: &str) -> Event {
    Event::default().comment(text)
}

pub fn respond<A: StreamAdapter>(
    mut generation: Generation,
    mut adapter: A,
    keepalive: Duration,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(64);
    tokio::spawn(async move {
        let keepalive = keepalive.max(Duration::from_millis(10));
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        if adapter.wants_cached_tokens() {
            // Until admission only SSE comments go out (a queued request keeps its client).
            let cached = loop {
                tokio::select! {
                    c = generation.admitted() => break c,
                    _ = ticker.tick() => {
                        if tx.send(comment("waiting for a free slot")).await.is_err() {
                            return;
                        }
                    }
                    _ = tx.closed() => return,
                }
            };
            // `None`: the request was dropped; its error follows from `next`.
            adapter.set_cached_tokens(cached.unwrap_or(0));
        }
        for e in adapter.start() {
            if tx.send(e).await.is_err() {
                return;
            }
        }
        loop {
            tokio::select! {
                batch = generation.next() => {
                    let Some(events) = batch else { return };
                    for ev in events {
                        for e in adapter.on_event(ev) {
                            if tx.send(e).await.is_err() {
                                return;
                            }
                        }
                    }
                    ticker.reset();
                }
                _ = ticker.tick() => {
                    if tx.send(adapter.keepalive()).await.is_err() {
                        return;
                    }
                }
                // The client left: returning drops the generation, which cancels it.
                _ = tx.closed() => return,
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(stream).into_response()
}
