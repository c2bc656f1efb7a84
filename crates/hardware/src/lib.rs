//! Capy Flash hardware check: what this machine has, which configuration of the product runs
//! on it, and the guards `serve` and `download` use before they start.
//!
//! - [`probe()`] reads the machine into a [`Machine`] (serialisable; `capy-flash doctor --json`
//!   prints it).
//! - [`configurations::CONFIGURATIONS`] is the configuration table, the one place its numbers
//!   live.
//! - [`plan()`] is pure: a verdict per configuration and the recommendation.
//! - [`model_folder::identify`] says which configuration a model folder is.
//! - [`guard::check_before_serve`] and [`guard::check_disk`] refuse with the numbers.

pub mod configurations;
pub mod guard;
pub mod machine;
pub mod model_folder;
pub mod plan;
pub mod probe;

pub use configurations::{Configuration, CONFIGURATIONS};
pub use machine::*;
pub use plan::{plan, Plan, Verdict};
pub use probe::{default_models_dir, probe, probe_at};
