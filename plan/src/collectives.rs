//! The collective check: every group's members agree, and no two devices could issue two
//! collectives in different orders (collectives block their stream until the whole group
//! arrives, so crossed orders deadlock, as with NCCL).

use super::order::{topological_positions, Reach};
use super::{ActorIndex, ActorKind, CollectiveConf, KernelConf, Plan, PlanError, Shape};
use std::collections::{BTreeMap, HashMap};

impl Plan {
    /// Collectives that block a stream other than a comm stream (a cpu device's compute
    /// stream, `ParallelOptions::collective_streams`): a member blocks its
    /// thread until every member has arrived, so nothing a blocked thread would do may be
    /// what another member waits for. The rule: such members run on cpu devices of one
    /// node, and no register joins two devices of a group that has such a member (the
    /// devices exchange nothing but collectives, issued in one order, which
    /// [`Plan::check_collective_order`] checks).
    pub fn check_blocking_collectives(&self) -> Result<(), PlanError> {
        let groups = self.collective_groups();
        // Per device, one group that blocks one of its streams.
        let mut blocking: Vec<(super::DeviceIndex, &str)> = Vec::new();
        for (a, actor) in self.actors.iter().enumerate() {
            let Some(conf) = self.collective_conf(a) else { continue };
            let stream = &self.streams[actor.stream.index()];
            if stream.kind == super::StreamKind::Comm {
                continue;
            }
            let device = &self.devices[stream.device.index()];
            let error = |detail: String| PlanError::Collective { group: conf.group.clone(), detail };
            if device.kind != super::DeviceKind::Cpu || stream.kind != super::StreamKind::Compute {
                return Err(error(format!(
                    "member '{}' runs on a {:?} stream of {}: a collective blocks its stream, which only a cpu \
                     device's compute stream may do besides comm streams",
                    actor.name,
                    stream.kind,
                    device.label()
                )));
            }
            if self.member_apart(&groups, &conf.group, device.node).is_some() {
                return Err(error(format!(
                    "member '{}' blocks a {:?} stream, and the group spans nodes: blocking collectives outside comm \
                     streams are built for groups within one process",
                    actor.name, stream.kind
                )));
            }
            if !blocking.iter().any(|(d, _)| *d == stream.device) {
                blocking.push((stream.device, conf.group.as_str()));
            }
        }
        if blocking.is_empty() {
            return Ok(());
        }
        let group_on = |d: super::DeviceIndex| blocking.iter().find(|(b, _)| *b == d).map(|(_, g)| *g);
        for desc in &self.regst_descs {
            let from = self.device_of(desc.producer);
            for consumer in &desc.consumers {
                let to = self.device_of(*consumer);
                let Some(group) = group_on(from).or_else(|| group_on(to)).filter(|_| from != to) else { continue };
                return Err(PlanError::Collective {
                    group: group.to_string(),
                    detail: format!(
                        "it blocks a compute stream, and register '{}' goes from {} to {}: a device whose thread is \
                         blocked in a collective could hold what the other waits for, so such devices may exchange \
                         nothing but collectives (run the collectives on comm streams)",
                        desc.name,
                        self.devices[from.index()].label(),
                        self.devices[to.index()].label()
                    ),
                });
            }
        }
        Ok(())
    }

    /// The collective actor `actor` runs (its group, rank, op, dtype and shape), or `None`
    /// for an actor that is not a collective member.
    pub fn collective_conf(&self, actor: usize) -> Option<&CollectiveConf> {
        match &self.actors[actor].kind {
            ActorKind::Compute { kernel: KernelConf::Collective(conf) } => Some(conf),
            _ => None,
        }
    }

    /// Per actor, the consumers of its registers that are not preloaded: what runs right
    /// after it within one step. (Preloaded registers carry a value into the next step.)
    pub fn within_step_successors(&self) -> Vec<Vec<usize>> {
        let mut successors = vec![Vec::new(); self.actors.len()];
        for desc in self.regst_descs.iter().filter(|d| d.preloaded == 0) {
            for consumer in &desc.consumers {
                successors[desc.producer.index()].push(consumer.index());
            }
        }
        successors
    }

    /// Checks every collective group (members, ranks, agreement on op, dtype and shape) and
    /// that every device issues its collectives in one order that all devices share.
    pub fn check_collective_order(&self) -> Result<(), PlanError> {
        let error = |group: &str, detail: String| PlanError::Collective { group: group.to_string(), detail };
        let groups = self.collective_groups();
        for (group, members) in &groups {
            let first =
                self.collective_conf(members[0]).ok_or_else(|| error(group, "lost (broken invariant)".into()))?;
            // By rank, not a vector of `size` slots: `size` comes from the plan file and may
            // claim 2^32 members.
            let mut ranks: BTreeMap<u32, usize> = BTreeMap::new();
            for &m in members {
                let conf = self.collective_conf(m).ok_or_else(|| error(group, "lost (broken invariant)".into()))?;
                let name = &self.actors[m].name;
                if (conf.size, conf.op, conf.dtype, &conf.shape) != (first.size, first.op, first.dtype, &first.shape) {
                    return Err(error(
                        group,
                        format!(
                            "member '{name}' ({} of {} on {}{}) disagrees with '{}' ({} of {} on {}{})",
                            conf.op_name(),
                            conf.size,
                            conf.dtype,
                            Shape::from(conf.shape.as_slice()),
                            self.actors[members[0]].name,
                            first.op_name(),
                            first.size,
                            first.dtype,
                            Shape::from(first.shape.as_slice())
                        ),
                    ));
                }
                if conf.rank >= conf.size {
                    return Err(error(group, format!("member '{name}' has rank {} of {}", conf.rank, conf.size)));
                }
                if let Some(other) = ranks.insert(conf.rank, m) {
                    return Err(error(
                        group,
                        format!("members '{}' and '{name}' both have rank {}", self.actors[other].name, conf.rank),
                    ));
                }
            }
            // Ranks are below `size` and distinct: the first rank missing is at most the
            // member count.
            if let Some(missing) = (0..first.size).find(|rank| !ranks.contains_key(rank)) {
                return Err(error(group, format!("rank {missing} of {} has no member", first.size)));
            }
            let mut devices: Vec<_> = members.iter().map(|&m| self.device_of(ActorIndex(m as u32))).collect();
            devices.sort_unstable();
            if devices.windows(2).any(|w| w[0] == w[1]) {
                return Err(error(group, "two members run on one device".into()));
            }
        }

        // Per stream: its collectives must be totally ordered within a step, and the orders
        // of all streams together must not cross. In a topological order of the step, a
        // stream's collectives are totally ordered exactly when each reaches the next one
        // (the compiler chains them, so that is usually a direct edge); the devices'
        // orders cross exactly when the graph of those consecutive pairs has a cycle.
        // Linear in the plan (plus the rare search when a pair is not chained directly).
        let successors = self.within_step_successors();
        let position = topological_positions(&successors);
        let mut by_stream: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for members in groups.values() {
            for &m in members {
                by_stream.entry(self.actors[m].stream.index()).or_default().push(m);
            }
        }
        // before[(g1, g2)] = a stream that issues g1 right before g2.
        let mut before: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        let mut search = Reach::new(self.actors.len());
        for (&stream, actors) in &mut by_stream {
            actors.sort_by_key(|&a| (position[a], a));
            for pair in actors.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                let (Some(x), Some(y)) = (self.collective_conf(a), self.collective_conf(b)) else { continue };
                let (ga, gb) = (x.group.as_str(), y.group.as_str());
                if !search.reaches(&successors, &position, a, b) {
                    return Err(PlanError::CollectiveOrder {
                        detail: format!(
                            "'{}' ({ga}) and '{}' ({gb}) on {} could be issued in either order: \
                             chain them so that every device issues them in one order",
                            self.actors[a].name,
                            self.actors[b].name,
                            self.stream_label(stream)
                        ),
                    });
                }
                before.entry((ga, gb)).or_insert(stream);
            }
        }
        for (&(ga, gb), &stream) in &before {
            if let Some(&other) = before.get(&(gb, ga)) {
                return Err(PlanError::CollectiveOrder {
                    detail: format!(
                        "{} issues '{ga}' before '{gb}', but {} issues '{gb}' before '{ga}'",
                        self.stream_label(stream),
                        self.stream_label(other)
                    ),
                });
            }
        }
        // Longer crossings (g1 < g2 on one device, g2 < g3 on another, g3 < g1 on a third).
        let names: Vec<&str> = groups.keys().copied().collect();
        let index: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let mut indegree = vec![0usize; names.len()];
        let mut next: Vec<Vec<usize>> = vec![Vec::new(); names.len()];
        for &(ga, gb) in before.keys() {
            let (a, b) = (index[ga], index[gb]);
            next[a].push(b);
            indegree[b] += 1;
        }
        let mut ready: Vec<usize> = (0..names.len()).filter(|&g| indegree[g] == 0).collect();
        let mut done = 0;
        while let Some(g) = ready.pop() {
            done += 1;
            for &h in &next[g] {
                indegree[h] -= 1;
                if indegree[h] == 0 {
                    ready.push(h);
                }
            }
        }
        if done != names.len() {
            let stuck: Vec<&str> = (0..names.len()).filter(|&g| indegree[g] > 0).map(|g| names[g]).collect();
            return Err(PlanError::CollectiveOrder {
                detail: format!("the devices' orders of collectives [{}] form a cycle", stuck.join(", ")),
            });
        }
        Ok(())
    }

    /// Each collective group's members, by group name.
    pub(crate) fn collective_groups(&self) -> BTreeMap<&str, Vec<usize>> {
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for a in 0..self.actors.len() {
            if let Some(conf) = self.collective_conf(a) {
                groups.entry(conf.group.as_str()).or_default().push(a);
            }
        }
        groups
    }

    /// A member of `group` (in `groups`, [`Plan::collective_groups`]) on another node than
    /// `node`, if any.
    pub(crate) fn member_apart(&self, groups: &BTreeMap<&str, Vec<usize>>, group: &str, node: u16) -> Option<usize> {
        let node_of = |a: usize| self.devices[self.streams[self.actors[a].stream.index()].device.index()].node;
        groups.get(group)?.iter().copied().find(|&a| node_of(a) != node)
    }

    fn stream_label(&self, stream: usize) -> String {
        let s = &self.streams[stream];
        let device = self.devices.get(s.device.index()).map(|d| d.label()).unwrap_or_default();
        format!("device {device} ({:?} stream)", s.kind).to_lowercase()
    }
}
