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
