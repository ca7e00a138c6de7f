//! The graphs of the check: for each module with child modules (a "folder", the crate root
//! included), its children are the nodes, and child a → child b is an edge when a path written
//! anywhere in a's subtree names an item in b's subtree. A path between a module and its own
//! ancestor or descendant is no edge (the root's own file names only its descendants), so each
//! path is an edge of exactly one folder: the deepest module that holds both ends.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;

use super::tree::Tree;

/// One edge of a folder's graph and the evidence for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    /// The first path (by file, then line) that makes the edge.
    pub file: PathBuf,
    pub line: u32,
    /// How many paths make it.
    pub count: usize,
}

/// One folder: a module and the edges between its children.
#[derive(Debug)]
pub struct Folder {
    pub module: usize,
    /// Keyed by (from child, to child).
    pub edges: BTreeMap<(usize, usize), Edge>,
}

/// Every folder of the tree (modules with at least one child), root first, then in tree order.
pub fn folders(t: &Tree) -> Vec<Folder> {
    let mut by_module: BTreeMap<usize, Folder> = BTreeMap::new();
    for (m, module) in t.modules.iter().enumerate() {
        if !module.children.is_empty() {
            by_module.insert(
                m,
                Folder {
                    module: m,
                    edges: BTreeMap::new(),
                },
            );
        }
    }
    for r in &t.refs {
        let (a, b) = (t.ancestry(r.from), t.ancestry(r.to));
        // The deepest common module, and the children of it on each side.
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let (Some(&from), Some(&to)) = (a.get(common), b.get(common)) else {
            continue; // one end is an ancestor of the other (or the same module)
        };
        let folder = a[common - 1];
        let Some(f) = by_module.get_mut(&folder) else {
            continue;
        };
        let e = f.edges.entry((from, to)).or_insert_with(|| Edge {
            from,
            to,
            file: r.file.clone(),
            line: r.line,
            count: 0,
        });
        e.count += 1;
        if (&r.file, r.line) < (&e.file, e.line) {
            e.file = r.file.clone();
            e.line = r.line;
        }
    }
    let mut order = Vec::new();
    preorder(t, 0, &mut order);
    order
        .into_iter()
        .filter_map(|m| by_module.remove(&m))
        .collect()
}

fn preorder(t: &Tree, m: usize, out: &mut Vec<usize>) {
    out.push(m);
    for &c in &t.modules[m].children {
        preorder(t, c, out);
    }
}

impl Folder {
    fn successors(&self, n: usize) -> impl Iterator<Item = usize> + '_ {
        self.edges
            .range((n, 0)..=(n, usize::MAX))
            .map(|((_, to), _)| *to)
    }

    /// The strongly connected groups of more than one child (Tarjan), each sorted.
    pub fn circles(&self, t: &Tree) -> Vec<Vec<usize>> {
        let nodes = &t.modules[self.module].children;
        let mut index: BTreeMap<usize, usize> = BTreeMap::new();
        let mut low: BTreeMap<usize, usize> = BTreeMap::new();
        let mut on_stack = BTreeSet::new();
        let mut stack = Vec::new();
        let mut out = Vec::new();
        let mut next = 0;
        for &n in nodes {
            if !index.contains_key(&n) {
                self.strongconnect(
                    n,
                    &mut next,
                    &mut index,
                    &mut low,
                    &mut on_stack,
                    &mut stack,
                    &mut out,
                );
            }
        }
        for c in &mut out {
            c.sort();
        }
        out.sort();
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn strongconnect(
        &self,
        v: usize,
        next: &mut usize,
        index: &mut BTreeMap<usize, usize>,
        low: &mut BTreeMap<usize, usize>,
        on_stack: &mut BTreeSet<usize>,
        stack: &mut Vec<usize>,
        out: &mut Vec<Vec<usize>>,
    ) {
        index.insert(v, *next);
        low.insert(v, *next);
        *next += 1;
        stack.push(v);
        on_stack.insert(v);
        for w in self.successors(v).collect::<Vec<_>>() {
            if !index.contains_key(&w) {
                self.strongconnect(w, next, index, low, on_stack, stack, out);
                let lw = low[&w];
                let lv = low.get_mut(&v).expect("visited");
                *lv = (*lv).min(lw);
            } else if on_stack.contains(&w) {
                let iw = index[&w];
                let lv = low.get_mut(&v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if low[&v] == index[&v] {
            let mut group = Vec::new();
            while let Some(w) = stack.pop() {
                on_stack.remove(&w);
                group.push(w);
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                out.push(group);
            }
        }
    }

    /// Cycles through every edge of a circle: for each edge u → v inside it, u → v then the
    /// shortest way back from v to u, without repeats (each cycle starts at its smallest module).
    /// Every edge that keeps the circle closed is in one of them.
    pub fn cycles(&self, circle: &[usize]) -> Vec<Vec<usize>> {
        let inside: BTreeSet<usize> = circle.iter().copied().collect();
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for (&(u, v), _) in self.edges.iter() {
            if !(inside.contains(&u) && inside.contains(&v)) {
                continue;
            }
            let Some(back) = self.shortest(v, u, &inside) else {
                continue;
            };
            // u, v, …, (u)
            let mut c = vec![u];
            c.extend(back.iter().take(back.len() - 1));
            let start = c
                .iter()
                .enumerate()
                .min_by_key(|(_, m)| **m)
                .map_or(0, |(i, _)| i);
            c.rotate_left(start);
            if seen.insert(c.clone()) {
                out.push(c);
            }
        }
        out.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        out
    }

    /// The shortest path from `a` to `b` inside `within` (both ends included).
    fn shortest(&self, a: usize, b: usize, within: &BTreeSet<usize>) -> Option<Vec<usize>> {
        let mut prev: BTreeMap<usize, usize> = BTreeMap::new();
        let mut queue = VecDeque::from([a]);
        let mut seen = BTreeSet::from([a]);
        while let Some(n) = queue.pop_front() {
            if n == b {
                let mut path = vec![b];
                while let Some(&p) = prev.get(path.last().unwrap_or(&b)) {
                    path.push(p);
                }
                path.reverse();
                return Some(path);
            }
            for w in self.successors(n) {
                if within.contains(&w) && seen.insert(w) {
                    prev.insert(w, n);
                    queue.push_back(w);
                }
            }
        }
        None
    }
}
