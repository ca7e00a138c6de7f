//! Fixture trees for the module check.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// A crate written into a temporary folder, removed on drop.
struct Fixture {
    dir: PathBuf,
}

impl Fixture {
    fn new(files: &[(&str, &str)]) -> Fixture {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "xtask-modules-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().expect("a file has a folder")).expect("mkdir");
            std::fs::write(&p, text).expect("write fixture");
        }
        Fixture { dir }
    }

    fn check(&self) -> Checked {
        self.check_skipping(&[])
    }

    fn check_skipping(&self, skip: &[&str]) -> Checked {
        let skip: Vec<PathBuf> = skip.iter().map(|s| self.dir.join(s)).collect();
        Checked::load("fixture", &self.dir.join("src/lib.rs"), &skip).expect("fixture loads")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `folder: a -> b file:line` for every edge.
fn edges(c: &Checked, base: &Path) -> Vec<String> {
    let t = &c.tree;
    let mut v = Vec::new();
    for f in &c.folders {
        for e in f.edges.values() {
            v.push(format!(
                "{}: {} -> {} {}:{}",
                t.path(f.module),
                t.modules[e.from].name,
                t.modules[e.to].name,
                shown(&e.file, base),
                e.line
            ));
        }
    }
    v
}

/// `folder: a -> b -> a` for every cycle.
fn cycles(c: &Checked) -> Vec<String> {
    let t = &c.tree;
    c.cycles()
        .into_iter()
        .map(|(f, cy)| {
            let mut names: Vec<&str> = cy.iter().map(|&m| t.modules[m].name.as_str()).collect();
            names.push(&t.modules[cy[0]].name);
            format!("{}: {}", t.path(f.module), names.join(" -> "))
        })
        .collect()
}

#[test]
fn a_cycle_through_nested_modules_is_found_at_the_common_folder() {
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod a;\nmod b;\n"),
        ("src/a.rs", "mod inner;\n"),
        (
            "src/a/inner.rs",
            "// uses b\n\nuse crate::b::deep::Thing;\n",
        ),
        ("src/b/mod.rs", "pub mod deep;\n"),
        (
            "src/b/deep/mod.rs",
            "pub struct Thing;\nfn f() -> crate::a::inner::X { todo!() }\n",
        ),
    ]);
    let c = fx.check();
    assert_eq!(
        edges(&c, &fx.dir),
        [
            "crate: a -> b src/a/inner.rs:3",
            "crate: b -> a src/b/deep/mod.rs:2",
        ]
    );
    assert_eq!(cycles(&c), ["crate: a -> b -> a"]);
    let (text, cyclic) = report(&[c], &fx.dir, false);
    assert!(cyclic);
    assert!(
        text.contains("circle in fixture crate (src/lib.rs): 2 modules import each other (a, b)"),
        "{text}"
    );
    assert!(text.contains("    a -> b  src/a/inner.rs:3\n"), "{text}");
    assert!(text.contains("    b -> a  src/b/deep/mod.rs:2\n"), "{text}");
}

#[test]
fn use_trees_with_braces_self_globs_and_renames_name_each_leaf() {
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod a;\nmod b;\nmod c;\nmod z;\npub struct Root;\n"),
        ("src/a.rs", "pub struct X;\n"),
        ("src/b/mod.rs", "pub mod inner;\npub struct D;\n"),
        ("src/b/inner.rs", ""),
        ("src/c.rs", "pub enum E { A, B }\n"),
        (
            "src/z.rs",
            "use crate::{\n    Root,\n    a::{self, X as Y},\n    b::{inner::*, D},\n};\nuse crate::c::E::{A, B};\n",
        ),
    ]);
    let c = fx.check();
    assert_eq!(
        edges(&c, &fx.dir),
        [
            "crate: z -> a src/z.rs:3",
            "crate: z -> b src/z.rs:4",
            "crate: z -> c src/z.rs:6",
        ]
    );
    // `Root` is an item of the root file: no edge. Each leaf counts: a (self, X), b (inner::*, D).
    let f = &c.folders[0];
    let count = |from: &str, to: &str| {
        let id = |n: &str| {
            c.tree
                .modules
                .iter()
                .position(|m| m.name == n)
                .expect("module")
        };
        f.edges[&(id(from), id(to))].count
    };
    assert_eq!(
        (count("z", "a"), count("z", "b"), count("z", "c")),
        (2, 2, 1)
    );
    assert!(cycles(&c).is_empty());
}

#[test]
fn super_super_paths_climb_and_make_edges_below_the_root() {
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod a;\n"),
        ("src/a/mod.rs", "mod b;\nmod d;\n"),
        ("src/a/b/mod.rs", "mod c;\n"),
        ("src/a/b/c.rs", "use super::super::d::Y;\n"),
        ("src/a/d.rs", "pub struct Y;\nuse self::super::b::Z;\n"),
    ]);
    let c = fx.check();
    assert_eq!(
        edges(&c, &fx.dir),
        [
            "crate::a: b -> d src/a/b/c.rs:1",
            "crate::a: d -> b src/a/d.rs:2"
        ]
    );
    assert_eq!(cycles(&c), ["crate::a: b -> d -> b"]);
}

#[test]
fn path_attribute_modules_resolve_as_rustc_does() {
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod p;\nmod q;\n"),
        // p.rs is not a mod.rs file: a `#[path]` in it is relative to src/, a plain `mod` to src/p/.
        (
            "src/p.rs",
            "#[path = \"impl_x.rs\"]\npub(crate) mod x;\nmod plain;\n",
        ),
        // A `#[path]` file is mod.rs-like: its `mod y;` is src/y.rs, beside it.
        ("src/impl_x.rs", "mod y;\n"),
        ("src/y.rs", "fn f() { crate::q::g(); }\n"),
        ("src/p/plain.rs", ""),
        (
            "src/q.rs",
            "pub fn g() {}\nmod inner {\n    #[path = \"deep.rs\"]\n    mod deep;\n}\n",
        ),
        // Inside an inline module of the non-mod.rs file q.rs: src/q/inner/deep.rs.
        ("src/q/inner/deep.rs", "use crate::p::x::y;\n"),
    ]);
    let c = fx.check();
    let t = &c.tree;
    let file_of = |n: &str| {
        let m = t.modules.iter().find(|m| m.name == n).expect("module");
        shown(&m.file, &fx.dir)
    };
    assert_eq!(file_of("x"), "src/impl_x.rs");
    assert_eq!(file_of("y"), "src/y.rs");
    assert_eq!(file_of("plain"), "src/p/plain.rs");
    assert_eq!(file_of("deep"), "src/q/inner/deep.rs");
    assert_eq!(
        edges(&c, &fx.dir),
        [
            "crate: p -> q src/y.rs:1",
            "crate: q -> p src/q/inner/deep.rs:1"
        ]
    );
    assert_eq!(cycles(&c), ["crate: p -> q -> p"]);
}

#[test]
fn a_cycle_only_through_inline_paths_attributes_and_macro_arguments() {
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod a;\nmod b;\nmod c;\n"),
        (
            "src/a.rs",
            "pub struct T;\nfn f() -> u32 {\n    crate::b::helper()\n}\n",
        ),
        (
            "src/b.rs",
            "pub fn helper() -> u32 { 1 }\n#[derive(crate :: c :: Derive)]\nstruct S;\n",
        ),
        (
            "src/c.rs",
            "fn g() {\n    println!(\"{:?}\", std::mem::size_of::<crate::a::T>());\n}\n",
        ),
    ]);
    let c = fx.check();
    assert_eq!(
        edges(&c, &fx.dir),
        [
            "crate: a -> b src/a.rs:3",
            "crate: b -> c src/b.rs:2",
            "crate: c -> a src/c.rs:2",
        ]
    );
    assert_eq!(cycles(&c), ["crate: a -> b -> c -> a"]);
}

#[test]
fn an_acyclic_tree_passes_and_comments_strings_and_ancestors_make_no_edge() {
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod a;\nmod b;\nuse crate::a::A;\n"),
        (
            "src/a.rs",
            "pub struct A;\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::a::A as Again;\n}\n",
        ),
        (
            "src/b.rs",
            concat!(
                "use crate::a::A;\n",
                "// crate::b is fine, and so is crate::a\n",
                "/// [`crate::b::x`]\n",
                "fn f() -> &'static str { \"crate::b::x\" }\n",
                "const R: &str = r#\"super::b::x\"#;\n",
                "pub(crate) fn g() {}\n",
                "pub(super) fn h() {}\n",
            ),
        ),
    ]);
    let c = fx.check();
    assert_eq!(edges(&c, &fx.dir), ["crate: b -> a src/b.rs:1"]);
    assert!(cycles(&c).is_empty());
    let (text, cyclic) = report(&[c], &fx.dir, true);
    assert!(!cyclic);
    assert!(
        text.contains("edges of fixture crate (src/lib.rs):\n  b -> a  src/b.rs:1 (1 path)"),
        "{text}"
    );
    assert!(
        text.contains("edges of fixture crate::a (src/a.rs):\n  (none)"),
        "{text}"
    );
    assert!(
        text.contains("1 edges between siblings, 0 cycle(s)"),
        "{text}"
    );
}

#[test]
fn an_inline_test_module_counts_for_its_file_module() {
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod a;\nmod b;\n"),
        (
            "src/a.rs",
            "#[cfg(test)]\nmod tests {\n    use crate::b::helper;\n}\n",
        ),
        (
            "src/b.rs",
            "pub fn helper() {}\nfn f() { super::a::thing(); }\n",
        ),
    ]);
    assert_eq!(cycles(&fx.check()), ["crate: a -> b -> a"]);
}

#[test]
fn skipped_folders_are_modules_whose_files_are_not_read() {
    let fx = Fixture::new(&[
        (
            "src/lib.rs",
            "#[path = \"generated/g.rs\"]\npub mod g;\nmod h;\n",
        ),
        (
            "src/generated/g.rs",
            "use crate::h::X;\nmod missing_but_unread;\n",
        ),
        ("src/h.rs", "use crate::g::Y;\n"),
    ]);
    let c = fx.check_skipping(&["src/generated"]);
    assert_eq!(edges(&c, &fx.dir), ["crate: h -> g src/h.rs:1"]);
    let (text, _) = report(&[c], &fx.dir, true);
    assert!(text.contains("not read: g (src/generated/g.rs"), "{text}");
}

#[test]
fn every_cycle_of_a_circle_is_shown_through_each_edge() {
    // a <-> b, b <-> c: one circle of three modules, two cycles.
    let fx = Fixture::new(&[
        ("src/lib.rs", "mod a;\nmod b;\nmod c;\n"),
        ("src/a.rs", "use crate::b::X;\n"),
        ("src/b.rs", "use crate::a::X;\nuse crate::c::X;\n"),
        ("src/c.rs", "use crate::b::X;\n"),
    ]);
    let c = fx.check();
    assert_eq!(cycles(&c), ["crate: a -> b -> a", "crate: b -> c -> b"]);
    let (text, _) = report(&[c], &fx.dir, false);
    assert!(
        text.contains("3 modules import each other (a, b, c); 2 cycle(s)"),
        "{text}"
    );
}

#[test]
fn a_missing_module_file_is_an_error_naming_the_declaration() {
    let fx = Fixture::new(&[("src/lib.rs", "\nmod gone;\n")]);
    let e = Tree::load(&fx.dir.join("src/lib.rs"), &[]).unwrap_err();
    assert!(e.contains("lib.rs:2: `mod gone;` has neither"), "{e}");
}

#[test]
fn this_crate_has_no_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let c = Checked::load("xtask-front", &root.join("src/lib.rs"), &[]).expect("loads");
    assert!(c.tree.modules.len() >= 6);
    assert_eq!(cycles(&c), Vec::<String>::new());
}
