//! Orders within one step of a plan, for the checks that ask what runs before what:
//! topological positions, reachability between actors, and each stream's chain.

use super::Plan;
use std::collections::VecDeque;

/// Each actor's position in a topological order of `successors` (Kahn's, first come first
/// served, so ties keep plan order); actors on a cycle get `usize::MAX`.
pub(crate) fn topological_positions(successors: &[Vec<usize>]) -> Vec<usize> {
    let n = successors.len();
    let mut indegree = vec![0usize; n];
    for next in successors {
        for &b in next {
            indegree[b] += 1;
        }
    }
    let mut ready: VecDeque<usize> = (0..n).filter(|&a| indegree[a] == 0).collect();
    let mut position = vec![usize::MAX; n];
    let mut at = 0;
    while let Some(a) = ready.pop_front() {
        position[a] = at;
        at += 1;
        for &b in &successors[a] {
            indegree[b] -= 1;
            if indegree[b] == 0 {
                ready.push_back(b);
            }
        }
    }
    position
}

/// Reachability queries that reuse one visited table (stamped per query, never cleared).
#[derive(Debug)]
pub(crate) struct Reach {
    stamp: Vec<u32>,
    query: u32,
    stack: Vec<usize>,
}

impl Reach {
    pub(crate) fn new(n: usize) -> Self {
        Self { stamp: vec![0; n], query: 0, stack: Vec::new() }
    }

    /// Whether a path leads from `from` to `to`, searching only actors that come before
    /// `to` in the topological order (no other can lead to it).
    pub(crate) fn reaches(&mut self, successors: &[Vec<usize>], position: &[usize], from: usize, to: usize) -> bool {
        if successors[from].contains(&to) {
            return true;
        }
        self.query += 1;
        self.stack.clear();
        self.stack.push(from);
        while let Some(a) = self.stack.pop() {
            if a == to {
                return true;
            }
            if self.stamp[a] == self.query || position[a] > position[to] {
                continue;
            }
            self.stamp[a] = self.query;
            self.stack.extend(successors[a].iter().copied());
        }
        false
    }
}

/// Per actor, its position on the longest path of its stream's actors within a step
/// (each reaching the next through a register that is not preloaded, so each is reached
/// from every actor before it on the path), or `None` off that path. In a compiled cpu plan
/// that path is the memory-sharing chain through every compute actor of the stream; its
/// sources and sinks are off it.
pub(crate) fn chain_positions(plan: &Plan) -> Vec<Option<u32>> {
    let n = plan.actors.len();
    // Within-step edges between actors of one stream.
    let mut successors = plan.within_step_successors();
    let mut predecessors: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (p, next) in successors.iter_mut().enumerate() {
        next.retain(|&c| c != p && plan.actors[c].stream == plan.actors[p].stream);
        for &c in next.iter() {
            predecessors[c].push(p);
        }
    }
    // Longest path ending at each actor, in topological order (actors on a cycle, which
    // validation refuses elsewhere, stay off every path), and the actor before it there.
    let position = topological_positions(&successors);
    let mut order: Vec<usize> = (0..n).filter(|&a| position[a] != usize::MAX).collect();
    order.sort_unstable_by_key(|&a| position[a]);
    let mut length = vec![0u32; n];
    let mut parent: Vec<Option<usize>> = vec![None; n];
    for &a in &order {
        let before = predecessors[a].iter().copied().filter(|&p| length[p] > 0).max_by_key(|&p| length[p]);
        length[a] = before.map_or(1, |p| length[p] + 1);
        parent[a] = before;
    }
    // Per stream, the end of its longest path, walked back.
    let mut end: Vec<Option<usize>> = vec![None; plan.streams.len()];
    for &a in &order {
        let Some(e) = end.get_mut(plan.actors[a].stream.index()) else { continue };
        if e.is_none_or(|b| length[a] > length[b]) {
            *e = Some(a);
        }
    }
    let mut chained = vec![None; n];
    for mut at in end.into_iter().flatten() {
        loop {
            chained[at] = Some(length[at] - 1);
            match parent[at] {
                Some(p) => at = p,
                None => break,
            }
        }
    }
    chained
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;

    /// One stream: a source feeding a chain `a → b → c → d` (zero-byte order registers), a
    /// side actor `e` that only `d` reads, a loop register from `d` back to `a` (preloaded,
    /// not an order within a step), and a second stream with one actor. Positions follow the
    /// longest path; the side actor, and actors whose stream has no longer path, have their
    /// own place on it or none.
    #[test]
    fn positions_follow_each_streams_longest_path() {
        let mut b = PlanBuilder::new();
        let device = b.device(0, DeviceKind::Cpu, 0);
        let (s0, s1) = (b.stream(device, StreamKind::Compute), b.stream(device, StreamKind::Comm));
        let noop = || ActorKind::Compute { kernel: KernelConf::Noop };
        let source = b.actor("source", s0, ActorKind::Source { pieces: SourcePieces::Count(2) });
        let [a, bb, c, d, e] = ["a", "b", "c", "d", "e"].map(|name| b.actor(name, s0, noop()));
        let other = b.actor("other", s1, noop());
        let fed = b.regst("source.out", source, 8, 1);
        b.consume(a, fed).consume(e, fed).consume(other, fed);
        for (from, to) in [(a, bb), (bb, c), (c, d), (e, d)] {
            let r = b.regst(&format!("{}->{}", from.0, to.0), from, 0, 1);
            b.consume(to, r);
        }
        let back = b.regst("d.loop", d, 8, 2);
        b.preload(back, 1);
        b.consume(a, back);
        let plan = b.plan_mut().clone();
        let positions = chain_positions(&plan);
        // source → a → b → c → d is the longest path of stream 0 (five actors).
        let on = |x: ActorIndex| positions[x.index()];
        assert_eq!([on(source), on(a), on(bb), on(c), on(d)], [Some(0), Some(1), Some(2), Some(3), Some(4)]);
        assert_eq!(on(e), None, "a side actor is off the path");
        assert_eq!(on(other), Some(0), "a stream of one actor is its own path");
    }
}
