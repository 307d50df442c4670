//! `Report`: the error type of a program's `main`, printed as the sentence it is.
//!
//! `fn main() -> Result<(), Box<dyn Error>>` prints a failure with `Debug`, which for most
//! errors is a struct dump (`OptimizerOption { option: "lr", ... }`). Returning
//! `Result<(), regflow::Report>` instead prints `Error: ` and the error's own sentence,
//! then each underlying cause on a line of its own, and `?` converts any error (or a
//! `String`) into it.

use std::error::Error;
use std::fmt;

/// An error that prints as its sentence and its causes, also through `Debug` (what Rust
/// prints when `main` returns it).
pub struct Report(Box<dyn Error>);

impl<E: Into<Box<dyn Error>>> From<E> for Report {
    fn from(error: E) -> Self {
        Self(error.into())
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, "\n  caused by: {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("the plan file cannot be read")
        }
    }

    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_report_debug_prints_the_sentence_and_its_causes() {
        let report = Report::from(Outer(std::io::Error::other("disk on fire")));
        assert_eq!(format!("{report:?}"), "the plan file cannot be read\n  caused by: disk on fire");
        let report = Report::from("steps must be at least 1");
        assert_eq!(format!("{report:?}"), "steps must be at least 1");
    }
}
