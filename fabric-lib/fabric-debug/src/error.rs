//! A small error type for the CLI: a message with the context chain, printed once by `main`.
use std::fmt;

/// An error message, already carrying its context (`"connecting to X: connection refused"`).
#[derive(Debug)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// Result of every fallible step of the tool.
pub type Result<T> = std::result::Result<T, Error>;

/// Builds an [`Error`] from a format string: `bail!("bad size {s}")` returns early.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::Error(format!($($arg)*)))
    };
}

/// Adds context to errors and missing values, like `anyhow::Context`.
pub trait Context<T> {
    /// Prefixes the error with `what` (evaluated eagerly; use [`Context::with_context`] for costly text).
    fn context(self, what: &str) -> Result<T>;
    /// Prefixes the error with the text `f` produces.
    fn with_context<F: FnOnce() -> String>(self, f: F) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn context(self, what: &str) -> Result<T> {
        self.map_err(|e| Error(format!("{what}: {e}")))
    }

    fn with_context<F: FnOnce() -> String>(self, f: F) -> Result<T> {
        self.map_err(|e| Error(format!("{}: {e}", f())))
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: &str) -> Result<T> {
        self.ok_or_else(|| Error(what.to_string()))
    }

    fn with_context<F: FnOnce() -> String>(self, f: F) -> Result<T> {
        self.ok_or_else(|| Error(f()))
    }
}
