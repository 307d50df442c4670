//! An index of a plan's edges, built once in time linear in the plan's size: each actor's
//! outputs, each actor's consumers, actors by name and which inputs close a loop. Job build
//! looks these up per actor instead of scanning every register descriptor per actor.

use super::*;
use std::collections::HashMap;

/// Lookups over one plan that [`Plan`] answers by scanning (see [`Plan::outputs_of`],
/// [`Plan::actor_by_name`], [`Plan::loop_inputs`]), answered from tables built once.
///
/// Built from any plan: references out of range (which validation rejects) are left out
/// rather than followed.
///
/// ```
/// use regflow_plan::{ActorKind, DeviceKind, KernelConf, PlanBuilder, PlanIndex, SourcePieces, StreamKind};
///
/// let mut b = PlanBuilder::new();
/// let cpu = b.device(0, DeviceKind::Cpu, 0);
/// let s = b.stream(cpu, StreamKind::Compute);
/// let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(1) });
/// let x = b.regst("x", src, 8, 2);
/// let sink = b.actor("sink", s, ActorKind::Sink);
/// b.consume(sink, x);
/// let plan = b.build().unwrap();
/// let index = PlanIndex::new(&plan);
/// assert_eq!(index.outputs_of(src), [x]);
/// assert_eq!(index.consumers_of(src), [sink]);
/// assert_eq!(index.actor_by_name("sink"), Some(sink));
/// assert_eq!(index.loop_inputs(sink), [false]);
/// ```
#[derive(Debug, Clone)]
pub struct PlanIndex<'p> {
    plan: &'p Plan,
    /// `outputs[output_start[a]..output_start[a + 1]]`: actor `a`'s outputs, in descriptor
    /// order (the kernel's output order).
    output_start: Vec<usize>,
    outputs: Vec<RegstDescId>,
    /// `consumers[consumer_start[a]..consumer_start[a + 1]]`: the actors reading actor `a`'s
    /// outputs, output by output, each output's consumers in its order (repeats possible).
    consumer_start: Vec<usize>,
    consumers: Vec<ActorIndex>,
    by_name: HashMap<&'p str, ActorIndex>,
    /// `closes_loop[input_start[a]..input_start[a + 1]]`: per input of actor `a`, whether it
    /// closes a loop.
    input_start: Vec<usize>,
    closes_loop: Vec<bool>,
}

impl<'p> PlanIndex<'p> {
    /// Indexes `plan`, in time linear in its actors, descriptors and edges.
    pub fn new(plan: &'p Plan) -> Self {
        let actors = plan.actors.len();
        let producer_of = |d: &RegstDesc| Some(d.producer.index()).filter(|&p| p < actors);

        // Outputs per actor, by counting then placing (descriptor order is kept).
        let mut output_start = vec![0usize; actors + 1];
        let mut consumer_start = vec![0usize; actors + 1];
        for desc in &plan.regst_descs {
            if let Some(p) = producer_of(desc) {
                output_start[p + 1] += 1;
                consumer_start[p + 1] += desc.consumers.iter().filter(|c| c.index() < actors).count();
            }
        }
        for a in 0..actors {
            output_start[a + 1] += output_start[a];
            consumer_start[a + 1] += consumer_start[a];
        }
        let mut outputs = vec![RegstDescId(0); output_start[actors]];
        let mut consumers = vec![ActorIndex(0); consumer_start[actors]];
        let (mut next_output, mut next_consumer) = (output_start.clone(), consumer_start.clone());
        for (d, desc) in plan.regst_descs.iter().enumerate() {
            let Some(p) = producer_of(desc) else { continue };
            outputs[next_output[p]] = RegstDescId(d as u32);
            next_output[p] += 1;
            for &c in desc.consumers.iter().filter(|c| c.index() < actors) {
                consumers[next_consumer[p]] = c;
                next_consumer[p] += 1;
            }
        }

        // The first actor of a name wins, as in `Plan::actor_by_name`.
        let mut by_name = HashMap::with_capacity(actors);
        for (a, actor) in plan.actors.iter().enumerate() {
            by_name.entry(actor.name.as_str()).or_insert(ActorIndex(a as u32));
        }

        let mut index = Self {
            plan,
            output_start,
            outputs,
            consumer_start,
            consumers,
            by_name,
            input_start: Vec::new(),
            closes_loop: Vec::new(),
        };
        index.find_loop_inputs();
        index
    }

    /// The indexed plan.
    pub fn plan(&self) -> &'p Plan {
        self.plan
    }

    /// Register descriptors produced by `actor`, in descriptor order (the kernel's
    /// outputs); empty for an actor the plan does not have.
    pub fn outputs_of(&self, actor: ActorIndex) -> &[RegstDescId] {
        let a = actor.index();
        match self.output_start.get(a..a + 2) {
            Some(&[start, end]) => &self.outputs[start..end],
            _ => &[],
        }
    }

    /// The actors that read `actor`'s outputs, output by output (an actor reading two of
    /// them appears twice).
    pub fn consumers_of(&self, actor: ActorIndex) -> &[ActorIndex] {
        let a = actor.index();
        match self.consumer_start.get(a..a + 2) {
            Some(&[start, end]) => &self.consumers[start..end],
            _ => &[],
        }
    }

    /// The actor with this name (the first one, if a plan that failed validation has two).
    pub fn actor_by_name(&self, name: &str) -> Option<ActorIndex> {
        self.by_name.get(name).copied()
    }

    /// For each input of `actor`, whether it closes a loop: the same answer as
    /// [`Plan::loop_inputs`], looked up.
    pub fn loop_inputs(&self, actor: ActorIndex) -> &[bool] {
        let a = actor.index();
        match self.input_start.get(a..a + 2) {
            Some(&[start, end]) => &self.closes_loop[start..end],
            _ => &[],
        }
    }

    /// Fills `closes_loop`. An input closes a loop when its register carries loop state and
    /// the reader reaches the register's producer. The producer reaches the reader through
    /// that register, so the reader reaches it back exactly when both lie in one strongly
    /// connected component: one pass of Tarjan's algorithm answers every input at once.
    fn find_loop_inputs(&mut self) {
        let plan = self.plan;
        let component = self.components();
        let carries = carries_loop_state(plan);
        let mut input_start = Vec::with_capacity(plan.actors.len() + 1);
        let mut closes_loop = Vec::new();
        input_start.push(0);
        for (a, actor) in plan.actors.iter().enumerate() {
            for input in &actor.inputs {
                let closes = plan.regst_descs.get(input.index()).is_some_and(|desc| {
                    carries[input.index()] && component.get(desc.producer.index()).is_some_and(|&c| c == component[a])
                });
                closes_loop.push(closes);
            }
            input_start.push(closes_loop.len());
        }
        self.input_start = input_start;
        self.closes_loop = closes_loop;
    }

    /// The strongly connected component of every actor (along every register, preloaded
    /// or not, and around every collective group), numbered arbitrarily. Iterative Tarjan,
    /// so a long chain cannot overflow the stack.
    ///
    /// The members of a collective group finish only together, so each depends on every
    /// other: a ring through them (one extra edge per member) puts them in one component.
    /// Without it, a variable of one device that another device copies in (a weight on a
    /// sub-mesh) was read by the copy as if from outside the loop, although the copy's
    /// device hands its gradient part back to the update through an all-reduce: the copy
    /// then saw one value more than the step's tick and ended the job with a piece order
    /// error.
    fn components(&self) -> Vec<usize> {
        const UNVISITED: usize = usize::MAX;
        let n = self.plan.actors.len();
        let mut ring_next: Vec<Option<usize>> = vec![None; n];
        for members in self.plan.collective_groups().values() {
            for (k, &member) in members.iter().enumerate() {
                ring_next[member] = Some(members[(k + 1) % members.len()]).filter(|&next| next != member);
            }
        }
        // The successor at position `next` of `a`'s list: its consumers, then its ring's next.
        let successor = |a: usize, next: usize| -> Option<usize> {
            let end = self.consumer_start[a + 1];
            match next.cmp(&end) {
                std::cmp::Ordering::Less => Some(self.consumers[next].index()),
                std::cmp::Ordering::Equal => ring_next[a],
                std::cmp::Ordering::Greater => None,
            }
        };
        let mut order = vec![UNVISITED; n];
        let mut low = vec![0usize; n];
        let mut component = vec![UNVISITED; n];
        let mut on_stack = vec![false; n];
        let mut stack = Vec::new();
        let (mut visited, mut components) = (0usize, 0usize);
        // (actor, next consumer position) frames of the depth-first search.
        let mut frames: Vec<(usize, usize)> = Vec::new();
        for root in 0..n {
            if order[root] != UNVISITED {
                continue;
            }
            frames.push((root, self.consumer_start[root]));
            order[root] = visited;
            low[root] = visited;
            visited += 1;
            stack.push(root);
            on_stack[root] = true;
            while let Some(&mut (a, ref mut next)) = frames.last_mut() {
                if let Some(c) = successor(a, *next) {
                    *next += 1;
                    if order[c] == UNVISITED {
                        order[c] = visited;
                        low[c] = visited;
                        visited += 1;
                        stack.push(c);
                        on_stack[c] = true;
                        frames.push((c, self.consumer_start[c]));
                    } else if on_stack[c] {
                        low[a] = low[a].min(order[c]);
                    }
                    continue;
                }
                frames.pop();
                if let Some(&(parent, _)) = frames.last() {
                    low[parent] = low[parent].min(low[a]);
                }
                if low[a] == order[a] {
                    while let Some(member) = stack.pop() {
                        on_stack[member] = false;
                        component[member] = components;
                        if member == a {
                            break;
                        }
                    }
                    components += 1;
                }
            }
        }
        component
    }
}

/// For every descriptor, whether it carries loop state (see `Plan::loop_inputs`): it is
/// preloaded, or a repeat hands on such a register. Each chain of repeats is walked once.
fn carries_loop_state(plan: &Plan) -> Vec<bool> {
    let mut known: Vec<Option<bool>> = vec![None; plan.regst_descs.len()];
    let mut path = Vec::new();
    for start in 0..plan.regst_descs.len() {
        let mut d = start;
        // A cycle of repeats with nothing preloaded carries nothing; the walk stops after
        // as many steps as there are descriptors.
        let answer = loop {
            if let Some(answer) = known[d] {
                break answer;
            }
            if path.len() > plan.regst_descs.len() {
                break false;
            }
            let desc = &plan.regst_descs[d];
            if desc.preloaded > 0 {
                break true;
            }
            let handed_on = match plan.actors.get(desc.producer.index()) {
                Some(ActorDesc { kind: ActorKind::Repeat { .. }, inputs, .. }) => inputs.first(),
                _ => None,
            };
            match handed_on.filter(|input| input.index() < plan.regst_descs.len()) {
                Some(input) => {
                    path.push(d);
                    d = input.index();
                }
                None => break false,
            }
        };
        known[d] = Some(answer);
        for p in path.drain(..) {
            known[p] = Some(answer);
        }
    }
    known.into_iter().map(|k| k.unwrap_or(false)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu_builder() -> (PlanBuilder, StreamIndex) {
        let mut b = PlanBuilder::new();
        let cpu = b.device(0, DeviceKind::Cpu, 0);
        let s = b.stream(cpu, StreamKind::Compute);
        (b, s)
    }

    fn compute() -> ActorKind {
        ActorKind::Compute { kernel: KernelConf::Copy }
    }

    /// Every lookup agrees with the scanning one of `Plan`. Returns how many inputs close a
    /// loop.
    fn assert_agrees_with_plan(plan: &Plan) -> usize {
        let index = PlanIndex::new(plan);
        for (a, actor) in plan.actors.iter().enumerate() {
            let a = ActorIndex(a as u32);
            assert_eq!(index.outputs_of(a), plan.outputs_of(a).collect::<Vec<_>>(), "outputs of {}", actor.name);
            let consumers: Vec<ActorIndex> =
                plan.outputs_of(a).flat_map(|r| plan.regst_descs[r.index()].consumers.clone()).collect();
            assert_eq!(index.consumers_of(a), consumers, "consumers of {}", actor.name);
            assert_eq!(index.actor_by_name(&actor.name), plan.actor_by_name(&actor.name));
            assert_eq!(index.loop_inputs(a), plan.loop_inputs(a), "loop inputs of {}", actor.name);
            // `Plan::loop_inputs` asks an index too: compare with a search of its own.
            assert_eq!(index.loop_inputs(a), scanning_loop_inputs(plan, a), "loop inputs of {}", actor.name);
        }
        assert_eq!(index.actor_by_name("nobody"), None);
        assert!(index.outputs_of(ActorIndex(plan.actors.len() as u32)).is_empty());
        index.closes_loop.iter().filter(|&&closes| closes).count()
    }

    /// `Plan::loop_inputs` by definition, one search per input: the register carries loop
    /// state and the reader reaches its producer.
    fn scanning_loop_inputs(plan: &Plan, actor: ActorIndex) -> Vec<bool> {
        fn carries(plan: &Plan, desc: RegstDescId) -> bool {
            let regst = &plan.regst_descs[desc.index()];
            let producer = &plan.actors[regst.producer.index()];
            regst.preloaded > 0
                || (matches!(producer.kind, ActorKind::Repeat { .. })
                    && producer.inputs.first().is_some_and(|&input| carries(plan, input)))
        }
        fn reaches(plan: &Plan, from: ActorIndex, to: ActorIndex) -> bool {
            let mut seen = vec![false; plan.actors.len()];
            let mut stack = vec![from];
            while let Some(a) = stack.pop() {
                if a == to {
                    return true;
                }
                if !std::mem::replace(&mut seen[a.index()], true) {
                    stack.extend(plan.outputs_of(a).flat_map(|d| plan.regst_descs[d.index()].consumers.clone()));
                    // A collective member reaches every member of its group.
                    if let Some(conf) = plan.collective_conf(a.index()) {
                        let group = |b: &usize| plan.collective_conf(*b).is_some_and(|c| c.group == conf.group);
                        stack.extend((0..plan.actors.len()).filter(group).map(|b| ActorIndex(b as u32)));
                    }
                }
            }
            false
        }
        let inputs = &plan.actors[actor.index()].inputs;
        inputs.iter().map(|&r| carries(plan, r) && reaches(plan, actor, plan.regst_descs[r.index()].producer)).collect()
    }

    #[test]
    fn a_training_loop_and_a_repeat_close_loops_like_the_plan_says() {
        // src -> forward(w) -> update(w) -> w (preloaded, read by forward and update), a
        // repeat handing w on to a reader inside the loop and a sink outside it.
        let (mut b, s) = cpu_builder();
        let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(4) });
        let x = b.regst("x", src, 8, 2);
        let update = b.actor("update", s, compute());
        let w = b.regst("w", update, 8, 1);
        b.preload(w, 1);
        let forward = b.actor("forward", s, compute());
        b.consume(forward, x).consume(forward, w);
        let grad = b.regst("grad", forward, 8, 1);
        b.consume(update, w).consume(update, grad);
        let repeat = b.actor("repeat", s, ActorKind::Repeat { count: 2 });
        b.consume(repeat, w);
        let repeated = b.regst("repeated", repeat, 8, 1);
        let reader = b.actor("reader", s, compute());
        b.consume(reader, repeated);
        let read = b.regst("read", reader, 8, 1);
        let sink = b.actor("sink", s, ActorKind::Sink);
        b.consume(sink, read);
        let plan = b.build().unwrap();
        assert_eq!(assert_agrees_with_plan(&plan), 2);
        let index = PlanIndex::new(&plan);
        assert_eq!(index.loop_inputs(update), [true, false]);
        assert_eq!(index.loop_inputs(forward), [false, true]);
        assert_eq!(index.loop_inputs(reader), [false]);
    }

    #[test]
    fn a_loop_closes_through_a_collective_group() {
        // Device 0 updates w (preloaded) from an all-reduce; device 1 copies w in and hands
        // its part to the same all-reduce: the copy is inside the loop, though no register
        // leads from it back to the update.
        let mut b = PlanBuilder::new();
        let streams: Vec<StreamIndex> = (0..2u16)
            .map(|d| {
                let device = b.device(0, DeviceKind::Cpu, d);
                b.stream(device, StreamKind::Compute)
            })
            .collect();
        let member = |b: &mut PlanBuilder, rank: u32| {
            let conf = crate::CollectiveConf {
                group: "g".into(),
                rank,
                size: 2,
                op: crate::CollectiveOp::AllReduce,
                dtype: crate::DType::F32,
                shape: vec![2],
            };
            let kind = ActorKind::Compute { kernel: KernelConf::Collective(conf) };
            b.actor(&format!("allreduce@{rank}"), streams[rank as usize], kind)
        };
        let update = b.actor("update", streams[0], compute());
        let w = b.regst("w", update, 8, 1);
        b.preload(w, 1);
        let copy = b.actor("copy@1", streams[1], compute());
        b.consume(copy, w);
        let copied = b.regst("copied", copy, 8, 1);
        let (m0, m1) = (member(&mut b, 0), member(&mut b, 1));
        b.consume(m1, copied);
        let own = b.actor("own@0", streams[0], compute());
        b.consume(own, w);
        let part = b.regst("part", own, 8, 1);
        b.consume(m0, part);
        let sum = b.regst("sum", m0, 8, 1);
        b.consume(update, w).consume(update, sum);
        let sum1 = b.regst("sum@1", m1, 8, 1);
        let sink = b.actor("sink", streams[1], ActorKind::Sink);
        b.consume(sink, sum1);
        let plan = b.plan_mut().clone();
        assert_eq!(assert_agrees_with_plan(&plan), 3);
        let index = PlanIndex::new(&plan);
        assert_eq!(index.loop_inputs(copy), [true]);
        assert_eq!(index.loop_inputs(own), [true]);
        assert_eq!(index.loop_inputs(sink), [false]);
    }

    #[test]
    fn a_long_chain_is_indexed_without_recursion() {
        let (mut b, s) = cpu_builder();
        let mut prev = b.actor("a0", s, ActorKind::Source { pieces: SourcePieces::Count(1) });
        for i in 1..100_000 {
            let r = b.regst(&format!("r{i}"), prev, 8, 1);
            let next = b.actor(&format!("a{i}"), s, if i == 99_999 { ActorKind::Sink } else { compute() });
            b.consume(next, r);
            prev = next;
        }
        let plan = b.plan_mut().clone();
        let index = PlanIndex::new(&plan);
        assert_eq!(index.outputs_of(ActorIndex(5)), [RegstDescId(5)]);
        assert_eq!(index.consumers_of(ActorIndex(5)), [ActorIndex(6)]);
        assert_eq!(index.actor_by_name("a99999"), Some(ActorIndex(99_999)));
        assert!((1..plan.actors.len()).all(|a| index.loop_inputs(ActorIndex(a as u32)) == [false]));
    }

    /// Random plans with preloaded registers on forward and backward edges and repeats
    /// (each handing on a register of an earlier actor, so repeats never form a cycle).
    #[test]
    fn random_plans_with_loops_agree_with_the_plan() {
        let mut rng = SplitMix64::new(3);
        let mut below = |n: usize| (rng.next_u64() % n as u64) as usize;
        let (mut closing, mut inputs) = (0, 0);
        for _ in 0..500 {
            let (mut b, s) = cpu_builder();
            let n = 2 + below(10);
            let actors: Vec<ActorIndex> = (0..n)
                .map(|i| {
                    let kind = if i > 0 && below(4) == 0 { ActorKind::Repeat { count: 2 } } else { compute() };
                    b.actor(&format!("a{i}"), s, kind)
                })
                .collect();
            let descs: Vec<RegstDescId> = actors
                .iter()
                .enumerate()
                .flat_map(|(i, &a)| (0..1 + below(2)).map(move |k| (i, a, k)))
                .map(|(i, a, k)| b.regst(&format!("r{i}.{k}"), a, 8, 2))
                .collect();
            for &d in &descs {
                if below(4) == 0 {
                    b.preload(d, 1);
                }
            }
            for (j, &actor) in actors.iter().enumerate() {
                let plan = b.plan_mut();
                let repeat = matches!(plan.actors[j].kind, ActorKind::Repeat { .. });
                let candidates: Vec<RegstDescId> = descs
                    .iter()
                    .copied()
                    .filter(|d| !repeat || plan.regst_descs[d.index()].producer.index() < j)
                    .collect();
                for _ in 0..if repeat { 1 } else { below(3) } {
                    let d = candidates[below(candidates.len())];
                    if !b.plan_mut().actors[j].inputs.contains(&d) {
                        b.consume(actor, d);
                    }
                }
            }
            closing += assert_agrees_with_plan(b.plan_mut());
            inputs += b.plan_mut().actors.iter().map(|a| a.inputs.len()).sum::<usize>();
        }
        // Both answers occur often enough to mean something.
        assert!(closing > inputs / 10 && closing < inputs * 9 / 10, "{closing} of {inputs} inputs close a loop");
    }

    #[test]
    fn out_of_range_references_are_left_out() {
        let (mut b, s) = cpu_builder();
        let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(1) });
        let x = b.regst("x", src, 8, 1);
        let sink = b.actor("sink", s, ActorKind::Sink);
        b.consume(sink, x);
        let mut plan = b.plan_mut().clone();
        plan.regst_descs[x.index()].consumers.push(ActorIndex(7));
        plan.actors[sink.index()].inputs.push(RegstDescId(9));
        let dangling = RegstDesc { producer: ActorIndex(42), ..plan.regst_descs[0].clone() };
        plan.regst_descs.push(dangling);
        let index = PlanIndex::new(&plan);
        assert_eq!(index.outputs_of(src), [x]);
        assert_eq!(index.consumers_of(src), [sink]);
        assert_eq!(index.loop_inputs(sink), [false, false]);
    }
}
