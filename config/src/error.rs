//! [`ConfigError`]: everything that can go wrong loading a configuration, each problem located at
//! `ORIGIN:LINE:COL` and named by its dotted key path.

use std::fmt;
use std::path::PathBuf;

/// Where in a source file a problem is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The file name (or other label) the source came from.
    pub origin: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// The key is not in the file: the problem is with its default value, and `line:column` is
    /// `1:1`.
    pub defaulted: bool,
}

/// One located problem: a key path, a message and (when it came from a file) a location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path (`tiers.g2.capacity`, `prefill[1].points_ms`); `None` when a syntax error
    /// cannot be tied to a key.
    pub key: Option<String>,
    /// What is wrong and, where possible, how to fix it.
    pub message: String,
    /// Where it is; `None` for a configuration that was built in memory.
    pub location: Option<Location>,
}

impl Problem {
    pub(crate) fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Problem { key: Some(key.into()), message: message.into(), location: None }
    }
}

/// Formats as `ORIGIN:LINE:COL: `KEY.PATH`: message`, leaving out the parts that are unknown.
impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(at) = &self.location {
            write!(f, "{}:{}:{}: ", at.origin, at.line, at.column)?;
        }
        if let Some(key) = &self.key {
            write!(f, "`{key}`: ")?;
        }
        f.write_str(&self.message)?;
        if self.location.as_ref().is_some_and(|at| at.defaulted) {
            f.write_str(" (default; the key is not set in the file)")?;
        }
        Ok(())
    }
}

/// A value that does not parse: a size, a duration or an enum name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ValueParseError {
    message: String,
}

impl ValueParseError {
    pub(crate) fn new(message: String) -> Self {
        ValueParseError { message }
    }
}

/// Why a configuration (or calibration) could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The source is not valid TOML.
    #[error("{0}")]
    Syntax(Problem),
    /// A key that the schema does not have (often a misspelling).
    #[error("{0}")]
    UnknownKey(Problem),
    /// A value of the wrong type, or one that does not parse (a size, a duration, an enum name).
    #[error("{0}")]
    InvalidValue(Problem),
    /// The file parsed, but values are impossible or inconsistent. Holds every problem found
    /// (never empty), one per line when displayed.
    #[error("{}", display_all(.0))]
    Invalid(Vec<Problem>),
}

fn display_all(problems: &[Problem]) -> String {
    problems.iter().map(Problem::to_string).collect::<Vec<_>>().join("\n")
}

impl ConfigError {
    /// A stable, low-cardinality name for the kind of error, usable as a metric label:
    /// `io`, `syntax`, `unknown_key`, `invalid_value` or `invalid`.
    pub fn kind(&self) -> &'static str {
        match self {
            ConfigError::Io { .. } => "io",
            ConfigError::Syntax(_) => "syntax",
            ConfigError::UnknownKey(_) => "unknown_key",
            ConfigError::InvalidValue(_) => "invalid_value",
            ConfigError::Invalid(_) => "invalid",
        }
    }

    /// Every located problem (one, except for [`ConfigError::Invalid`]; none for
    /// [`ConfigError::Io`]).
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Io { .. } => &[],
            ConfigError::Syntax(p) | ConfigError::UnknownKey(p) | ConfigError::InvalidValue(p) => {
                std::slice::from_ref(p)
            }
            ConfigError::Invalid(ps) => ps,
        }
    }

    fn first_location(&self) -> Option<&Location> {
        self.problems().first()?.location.as_ref()
    }

    /// 1-based line of the (first) problem, when it came from a file.
    pub fn line(&self) -> Option<usize> {
        self.first_location().map(|at| at.line)
    }

    /// 1-based column of the (first) problem, when it came from a file.
    pub fn column(&self) -> Option<usize> {
        self.first_location().map(|at| at.column)
    }

    /// Dotted key path of the (first) problem.
    pub fn key(&self) -> Option<&str> {
        self.problems().first()?.key.as_deref()
    }

    /// Message of the (first) problem, without location or key.
    pub fn message(&self) -> Option<&str> {
        self.problems().first().map(|p| p.message.as_str())
    }
}
