//! Fetches: fetchers asked of the wrong actor, twice, or of a sink that delivers to a
//! callback.

use crate::feeds::{fed_chain, with_job};
use crate::{quick, Catalogue};

#[test]
fn fetches() {
    let mut c = Catalogue::new("fetches");
    c.case(
        "a fetcher for an unknown actor",
        || with_job(fed_chain(), |job| job.fetcher("snk").map(drop)),
        "RuntimeError::UnknownName",
        &["'snk'"],
    );
    c.case(
        "a fetcher for a compute actor",
        || with_job(fed_chain(), |job| job.fetcher("f").map(drop)),
        "RuntimeError::WrongKind",
        &["'f'", "compute actor", "a fetcher needs a sink"],
    );
    c.case(
        "a fetcher for a fed source",
        || with_job(fed_chain(), |job| job.fetcher("src").map(drop)),
        "RuntimeError::WrongKind",
        &["'src'", "source", "a fetcher needs a sink"],
    );
    c.case(
        "a fetcher for a counted source",
        || with_job(fed_chain(), |job| job.fetcher("count").map(drop)),
        "RuntimeError::WrongKind",
        &["'count'", "source"],
    );
    c.case(
        "a fetcher taken twice",
        || {
            with_job(fed_chain(), |job| {
                let first = job.fetcher("sink")?;
                let second = job.fetcher("sink").map(drop);
                drop(first);
                second
            })
        },
        "RuntimeError::AlreadyTaken",
        &["fetcher", "'sink'"],
    );
    c.case(
        "a fetcher with an empty name",
        || with_job(fed_chain(), |job| job.fetcher("").map(drop)),
        "RuntimeError::UnknownName",
        &["''"],
    );
    c.finish();
}

#[test]
fn a_fetcher_of_a_sink_with_a_callback_names_the_callback() {
    let mut c = Catalogue::new("fetches");
    c.case(
        "a fetcher for a sink that delivers to a callback",
        || {
            let mut job = quick(fed_chain()).on_sink("tail", |_| {}).build()?;
            let fetcher = job.fetcher("tail").map(drop);
            drop(job.feeder("src"));
            let _ = job.wait();
            fetcher
        },
        "RuntimeError::WrongKind",
        &["'tail'", "on_sink"],
    );
    c.finish();
}
