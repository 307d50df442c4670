//! The progress check: plans whose register counts allow a wait-for cycle are caught with
//! the cycle named; the same plans with enough slots pass, with their repetition vectors.

use regflow_actors::{check_progress, ProgressError};
use regflow_plan::{ActorKind, DeviceKind, KernelConf, Plan, PlanBuilder, SourcePieces, StreamKind};

fn compute() -> ActorKind {
    ActorKind::Compute { kernel: KernelConf::Noop }
}

/// `src -> a -> join` and `src -> acc(k) -> repeat(k) -> join`: `join` needs `a`'s piece
/// and the repeat's, which needs k pieces of `src` first. `a`'s output must hold k pieces
/// while the acc collects, or nobody can move.
fn accumulate_beside_a_bypass(k: u32, bypass_slots: u32) -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 8, 1);
    let a = b.actor("a", s, compute());
    b.consume(a, x);
    let ax = b.regst("a.out", a, 8, bypass_slots);
    let acc = b.actor("acc", s, ActorKind::Acc { count: k, kernel: KernelConf::Noop });
    b.consume(acc, x);
    let summed = b.regst("acc.out", acc, 8, 1);
    let repeat = b.actor("repeat", s, ActorKind::Repeat { count: k });
    b.consume(repeat, summed);
    let repeated = b.regst("repeat.out", repeat, 8, 1);
    let join = b.actor("join", s, compute());
    b.consume(join, ax).consume(join, repeated);
    let out = b.regst("join.out", join, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, out);
    b.build().unwrap()
}

#[test]
fn a_bypass_shorter_than_the_accumulation_is_a_deadlock_naming_the_cycle() {
    let err = check_progress(&accumulate_beside_a_bypass(3, 1), 2).unwrap_err();
    let ProgressError::Deadlock(deadlock) = &err else { panic!("expected a deadlock, got {err}") };
    let message = err.to_string();
    assert!(!deadlock.cycle.is_empty(), "{message}");
    let on_cycle: Vec<&str> = deadlock.cycle.iter().map(|e| e.waiter.as_str()).collect();
    assert!(on_cycle.contains(&"a") && on_cycle.contains(&"src"), "{message}");
    assert!(message.contains("'a.out'") && message.contains("all 1 slot(s)"), "{message}");
    assert!(deadlock.registers().any(|(r, n)| r == "a.out" && n == 1), "{message}");
}

#[test]
fn a_bypass_as_deep_as_the_accumulation_runs_every_step() {
    for k in 1..=8 {
        let plan = accumulate_beside_a_bypass(k, k);
        let progress = check_progress(&plan, 2).unwrap_or_else(|e| panic!("k = {k}: {e}"));
        let firings = |name: &str| progress.per_step[plan.actor_by_name(name).unwrap().index()];
        assert_eq!((firings("src"), firings("a"), firings("acc")), (u64::from(k), u64::from(k), u64::from(k)));
        assert_eq!((firings("repeat"), firings("join"), firings("sink")), (u64::from(k), u64::from(k), u64::from(k)));
        // The acc emits once per step; its consumer still reads that piece k times.
        assert_eq!(progress.fired, 2 * 6 * u64::from(k));
    }
}

/// A compute actor that reads its own output as a step token (what memory sharing once
/// gave a lone compute actor): it needs a free slot of the register it still reads.
#[test]
fn an_actor_waiting_on_its_own_token_is_a_deadlock() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(4) });
    let x = b.regst("x", src, 8, 2);
    let op = b.actor("sum", s, compute());
    let token = b.regst("sum.token", op, 0, 1);
    b.preload(token, 1);
    b.consume(op, x).consume(op, token);
    let plan = b.build().unwrap();
    let err = check_progress(&plan, 2).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("cycle: 'sum'") && message.contains("'sum.token'"), "{message}");
}

#[test]
fn rates_that_cannot_balance_are_named() {
    // `join` reads the source directly and through an acc of 2: one of its inputs would
    // run dry or pile up whatever the register counts.
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(4) });
    let x = b.regst("x", src, 8, 4);
    let acc = b.actor("acc", s, ActorKind::Acc { count: 2, kernel: KernelConf::Noop });
    b.consume(acc, x);
    let half = b.regst("acc.out", acc, 8, 1);
    let join = b.actor("join", s, compute());
    b.consume(join, x).consume(join, half);
    let out = b.regst("join.out", join, 8, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, out);
    let plan = b.build().unwrap();
    let err = check_progress(&plan, 2).unwrap_err();
    assert!(matches!(err, ProgressError::Rates { .. }), "{err}");
    let message = err.to_string();
    assert!(message.contains("rates disagree") && message.contains("'join'"), "{message}");
}
