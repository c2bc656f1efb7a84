//! The built-in demo model.
