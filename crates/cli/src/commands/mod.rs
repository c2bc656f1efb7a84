//! One module per subcommand.

pub mod score;
