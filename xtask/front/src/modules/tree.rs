//! A crate's module tree, found as rustc finds it (`mod a;` → `a.rs` or `a/mod.rs` beside a
//! `mod.rs`-like file, under `name/` beside any other; `#[path = "…"]` relative to the declaring
//! file's folder; inline `mod a { … }`), and every `crate::…`, `super::…` and `self::…` path of its
//! sources resolved to the module it names.

use std::path::{Path, PathBuf};

use super::lex::{lex, Tok, Token};

/// One module: a file or an inline `mod name { … }`.
#[derive(Debug)]
pub struct Module {
    /// `crate` for the root.
    pub name: String,
    pub parent: Option<usize>,
    pub children: Vec<usize>,
    /// The file that holds the module's items (for an inline module, the file it is written in).
    pub file: PathBuf,
    /// Where the module is declared (`mod name;` or `mod name {`): file and line.
    pub decl: Option<(PathBuf, u32)>,
    /// Whether its file was read (files under a skipped folder are not).
    pub scanned: bool,
    /// Where `mod x;` inside this module finds `x.rs` / `x/mod.rs`.
    child_dir: PathBuf,
    /// What `#[path = "…"]` on a `mod x;` inside this module is relative to.
    path_dir: PathBuf,
}

/// One path of the sources: written in module `from` (file and line), naming an item of module
/// `to` (the deepest module the path walks through).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ref {
    pub from: usize,
    pub to: usize,
    pub file: PathBuf,
    pub line: u32,
}

/// A crate's modules (index 0 is the root) and the paths of its sources.
#[derive(Debug)]
pub struct Tree {
    pub modules: Vec<Module>,
    pub refs: Vec<Ref>,
}

struct FileToks {
    file: PathBuf,
    toks: Vec<Token>,
    /// The module each token belongs to.
    scope: Vec<usize>,
}

impl Tree {
    /// Read the crate whose root file is `root`; files under any of `skip` are modules whose
    /// contents are not read (and whose `mod` declarations are therefore not followed).
    pub fn load(root: &Path, skip: &[PathBuf]) -> Result<Tree, String> {
        let dir = root.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut t = Tree {
            modules: vec![Module {
                name: "crate".into(),
                parent: None,
                children: Vec::new(),
                file: root.to_path_buf(),
                decl: None,
                scanned: false,
                child_dir: dir.clone(),
                path_dir: dir,
            }],
            refs: Vec::new(),
        };
        let mut files = Vec::new();
        t.load_file(0, skip, &mut files)?;
        for f in &files {
            t.resolve_paths(f);
        }
        Ok(t)
    }

    /// `crate::a::b` for module `m`.
    pub fn path(&self, m: usize) -> String {
        let mut names = Vec::new();
        let mut cur = Some(m);
        while let Some(c) = cur {
            names.push(self.modules[c].name.as_str());
            cur = self.modules[c].parent;
        }
        names.reverse();
        names.join("::")
    }

    /// The modules from the root down to `m`, both included.
    pub fn ancestry(&self, m: usize) -> Vec<usize> {
        let mut v = vec![m];
        while let Some(p) = self.modules[*v.last().unwrap_or(&0)].parent {
            v.push(p);
        }
        v.reverse();
        v
    }

    fn child(&self, m: usize, name: &str) -> Option<usize> {
        self.modules[m]
            .children
            .iter()
            .copied()
            .find(|&c| self.modules[c].name == name)
    }

    fn add(&mut self, parent: usize, m: Module) -> usize {
        let id = self.modules.len();
        self.modules.push(m);
        self.modules[parent].children.push(id);
        id
    }

    /// Read module `m`'s file: its inline modules, its `mod x;` declarations (followed, depth
    /// first) and the tokens for [`Tree::resolve_paths`].
    fn load_file(
        &mut self,
        m: usize,
        skip: &[PathBuf],
        files: &mut Vec<FileToks>,
    ) -> Result<(), String> {
        let file = self.modules[m].file.clone();
        if skip.iter().any(|s| file.starts_with(s)) {
            return Ok(());
        }
        let src = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let toks = lex(&src).map_err(|e| format!("{}: {e}", file.display()))?;
        self.modules[m].scanned = true;
        let mut scope = Vec::with_capacity(toks.len());
        // (module, brace depth inside its `{`)
        let mut stack: Vec<(usize, usize)> = vec![(m, 0)];
        let mut depth = 0usize;
        let mut outlined = Vec::new();
        let mut i = 0;
        while i < toks.len() {
            let cur = stack.last().map_or(m, |s| s.0);
            scope.push(cur);
            let t = &toks[i];
            if t.is_punct('{') {
                depth += 1;
            } else if t.is_punct('}') {
                if stack.len() > 1 && stack.last().is_some_and(|s| s.1 == depth) {
                    stack.pop();
                }
                depth = depth.saturating_sub(1);
            } else if t.is_kw("mod") {
                if let (Some(name), Some(next)) =
                    (toks.get(i + 1).and_then(|n| n.ident()), toks.get(i + 2))
                {
                    if next.is_punct(';') || next.is_punct('{') {
                        let path_attr = path_attribute(&toks, i);
                        let (pd, cd) = (
                            self.modules[cur].path_dir.clone(),
                            self.modules[cur].child_dir.clone(),
                        );
                        let decl = Some((file.clone(), t.line));
                        if next.is_punct('{') {
                            let dir = match &path_attr {
                                Some(p) => pd.join(p),
                                None => cd.join(name),
                            };
                            let id = self.add(
                                cur,
                                Module {
                                    name: name.to_string(),
                                    parent: Some(cur),
                                    children: Vec::new(),
                                    file: file.clone(),
                                    decl,
                                    scanned: true,
                                    child_dir: dir.clone(),
                                    path_dir: dir,
                                },
                            );
                            scope.push(cur);
                            scope.push(cur);
                            depth += 1;
                            stack.push((id, depth));
                            i += 3;
                            continue;
                        }
                        let (child_file, child_dir) = match &path_attr {
                            // A `#[path]` file is a mod.rs-like file: its own `mod y;` are siblings.
                            Some(p) => {
                                let f = pd.join(p);
                                let d = f.parent().map(Path::to_path_buf).unwrap_or_default();
                                (f, d)
                            }
                            None => {
                                let flat = cd.join(format!("{name}.rs"));
                                let nested = cd.join(name).join("mod.rs");
                                if flat.is_file() {
                                    (flat, cd.join(name))
                                } else if nested.is_file() {
                                    (nested, cd.join(name))
                                } else {
                                    return Err(format!(
                                        "{}:{}: `mod {name};` has neither {} nor {}",
                                        file.display(),
                                        t.line,
                                        flat.display(),
                                        nested.display()
                                    ));
                                }
                            }
                        };
                        let path_dir = child_file
                            .parent()
                            .map(Path::to_path_buf)
                            .unwrap_or_default();
                        let id = self.add(
                            cur,
                            Module {
                                name: name.to_string(),
                                parent: Some(cur),
                                children: Vec::new(),
                                file: child_file,
                                decl,
                                scanned: false,
                                child_dir,
                                path_dir,
                            },
                        );
                        outlined.push(id);
                    }
                }
            }
            i += 1;
        }
        files.push(FileToks { file, toks, scope });
        for id in outlined {
            self.load_file(id, skip, files)?;
        }
        Ok(())
    }

    /// Record every `crate::`, `super::` and `self::` path of one file.
    fn resolve_paths(&mut self, f: &FileToks) {
        let toks = &f.toks;
        let mut i = 0;
        while i < toks.len() {
            let t = &toks[i];
            let starts = (t.is_kw("crate") || t.is_kw("super") || t.is_kw("self"))
                && toks.get(i + 1).is_some_and(|n| n.tok == Tok::PathSep)
                && !(i > 0 && toks[i - 1].tok == Tok::PathSep);
            if !starts {
                i += 1;
                continue;
            }
            let here = f.scope[i];
            let start = if t.is_kw("crate") {
                Some(0)
            } else if t.is_kw("super") {
                self.modules[here].parent
            } else {
                Some(here)
            };
            let mut out = Vec::new();
            let end = self.walk(toks, i + 1, start, t.line, &mut out);
            for (to, line) in out {
                self.refs.push(Ref {
                    from: here,
                    to,
                    file: f.file.clone(),
                    line,
                });
            }
            i = end.max(i + 1);
        }
    }

    /// Walk the rest of a path from `toks[i]` (at a `::`, or at the first segment inside a use
    /// group) starting in module `at` (`None`: outside the tree, e.g. `super` of the root).
    /// Pushes (module named, line) for each leaf; returns the index after the path.
    fn walk(
        &self,
        toks: &[Token],
        mut i: usize,
        mut at: Option<usize>,
        mut line: u32,
        out: &mut Vec<(usize, u32)>,
    ) -> usize {
        // Whether the walk still follows modules (false once a segment names an item).
        let mut in_tree = at.is_some();
        loop {
            // Expect `::` before each further segment, except at the start of a group element.
            if toks.get(i).is_some_and(|t| t.tok == Tok::PathSep) {
                i += 1;
            } else {
                break;
            }
            let Some(t) = toks.get(i) else { break };
            if t.is_punct('{') {
                // Inside the tree the group's leaves say what is named; past an item (`E::{A,
                // B}`) the whole group names items of the last module.
                if !in_tree {
                    if let Some(m) = at {
                        out.push((m, line));
                    }
                }
                let end = self.group(toks, i, if in_tree { at } else { None }, out);
                return skip_rename(toks, end);
            }
            if t.is_punct('*') {
                i += 1;
                break;
            }
            if t.is_kw("super") && in_tree {
                at = at.and_then(|m| self.modules[m].parent);
                in_tree = at.is_some();
                line = t.line;
                i += 1;
                continue;
            }
            if t.is_kw("self") {
                i += 1;
                continue;
            }
            match t.ident() {
                Some(name) => {
                    if in_tree {
                        match at.and_then(|m| self.child(m, name)) {
                            Some(c) => {
                                at = Some(c);
                                line = t.line;
                            }
                            None => in_tree = false,
                        }
                    }
                    i += 1;
                }
                // `::<` (turbofish) or anything else ends the path.
                None => break,
            }
        }
        if let Some(m) = at {
            out.push((m, line));
        }
        skip_rename(toks, i)
    }

    /// A use group at `toks[open]` (`{`) under module `base`; returns the index after its `}`.
    fn group(
        &self,
        toks: &[Token],
        open: usize,
        base: Option<usize>,
        out: &mut Vec<(usize, u32)>,
    ) -> usize {
        let mut i = open + 1;
        while i < toks.len() {
            let t = &toks[i];
            if t.is_punct('}') {
                return i + 1;
            }
            if t.is_punct(',') {
                i += 1;
                continue;
            }
            // One element: its first segment here, the rest through `walk`.
            let (at, next) = if t.is_punct('{') {
                i = self.group(toks, i, base, out);
                continue;
            } else if t.is_punct('*') || t.is_kw("self") {
                (base, i + 1)
            } else if t.is_kw("super") {
                (base.and_then(|m| self.modules[m].parent), i + 1)
            } else if let Some(name) = t.ident() {
                match base.and_then(|m| self.child(m, name)) {
                    Some(c) => (Some(c), i + 1),
                    None => {
                        // An item of `base`: the element names `base` (whatever follows).
                        if let Some(b) = base {
                            out.push((b, t.line));
                        }
                        i = self.walk(toks, i + 1, None, t.line, out);
                        continue;
                    }
                }
            } else {
                // Not a use tree after all (e.g. a struct literal after a path): stop here.
                return i;
            };
            i = self.walk(toks, next, at, t.line, out);
        }
        i
    }
}

/// Past an optional `as name`.
fn skip_rename(toks: &[Token], i: usize) -> usize {
    if toks.get(i).is_some_and(|t| t.is_kw("as"))
        && toks.get(i + 1).and_then(Token::ident).is_some()
    {
        i + 2
    } else {
        i
    }
}

/// The `#[path = "…"]` among the outer attributes before the `mod` at `toks[m]` (past a
/// visibility such as `pub` or `pub(crate)`).
fn path_attribute(toks: &[Token], m: usize) -> Option<String> {
    let mut j = m;
    // Visibility: `pub`, `pub(crate)`, `pub(in crate::a)`.
    if j > 0 && toks[j - 1].is_punct(')') {
        let open = matching_open(toks, j - 1, '(', ')')?;
        if open > 0 && toks[open - 1].is_kw("pub") {
            j = open - 1;
        }
    } else if j > 0 && toks[j - 1].is_kw("pub") {
        j -= 1;
    }
    let mut found = None;
    while j > 0 && toks[j - 1].is_punct(']') {
        let open = matching_open(toks, j - 1, '[', ']')?;
        if open == 0 || !toks[open - 1].is_punct('#') {
            break;
        }
        let body = &toks[open + 1..j - 1];
        if let [a, eq, Token {
            tok: Tok::Str(p), ..
        }] = body
        {
            if a.is_kw("path") && eq.is_punct('=') {
                found = Some(p.clone());
            }
        }
        j = open - 1;
    }
    found
}

/// The index of the `open` that matches the `close` at `toks[c]`.
fn matching_open(toks: &[Token], c: usize, open: char, close: char) -> Option<usize> {
    let mut depth = 0usize;
    let mut k = c;
    loop {
        if toks[k].is_punct(close) {
            depth += 1;
        } else if toks[k].is_punct(open) {
            depth -= 1;
            if depth == 0 {
                return Some(k);
            }
        }
        k = k.checked_sub(1)?;
    }
}
