//! A Rust tokenizer just fine enough for the module check: identifiers, `::`, single punctuation
//! and string literals (kept: `#[path = "…"]` needs them), each with its line; comments are
//! dropped, and so is the content of every other literal (numbers, characters, lifetimes), so
//! nothing inside a comment or a string is ever read as a path.

/// One token's kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tok {
    /// An identifier or keyword; `raw` for `r#name` (which is never a keyword).
    Ident { name: String, raw: bool },
    /// `::`
    PathSep,
    /// Any other punctuation character.
    Punct(char),
    /// A string literal's text as written between the quotes (escapes left as they are): what
    /// `#[path = "…"]` holds.
    Str(String),
    /// A number, character, byte or lifetime: nothing the check reads.
    Other,
}

/// A token and the line (1-based) where it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    pub tok: Tok,
    pub line: u32,
}

impl Token {
    /// Whether this is the keyword (not raw identifier) `kw`.
    pub fn is_kw(&self, kw: &str) -> bool {
        matches!(&self.tok, Tok::Ident { name, raw: false } if name == kw)
    }

    /// Whether this is the punctuation `c`.
    pub fn is_punct(&self, c: char) -> bool {
        self.tok == Tok::Punct(c)
    }

    /// An identifier's name (raw identifiers without their `r#`).
    pub fn ident(&self) -> Option<&str> {
        match &self.tok {
            Tok::Ident { name, .. } => Some(name),
            _ => None,
        }
    }
}

fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}

fn is_ident_continue(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

struct Lexer<'a> {
    s: &'a [char],
    i: usize,
    line: u32,
}

impl Lexer<'_> {
    fn peek(&self, k: usize) -> Option<char> {
        self.s.get(self.i + k).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.s.get(self.i).copied()?;
        self.i += 1;
        if c == '\n' {
            self.line += 1;
        }
        Some(c)
    }

    /// After the opening `"`: up to and including the closing one; returns the text between.
    fn quoted(&mut self, start_line: u32) -> Result<String, String> {
        let mut text = String::new();
        loop {
            match self.bump() {
                None => return Err(format!("line {start_line}: unterminated string literal")),
                Some('"') => return Ok(text),
                Some('\\') => {
                    text.push('\\');
                    if let Some(c) = self.bump() {
                        text.push(c);
                    }
                }
                Some(c) => text.push(c),
            }
        }
    }

    /// At the `#`s or `"` after `r`: a raw string; returns its text.
    fn raw_string(&mut self, start_line: u32) -> Result<String, String> {
        let mut hashes = 0;
        while self.peek(0) == Some('#') {
            self.bump();
            hashes += 1;
        }
        if self.bump() != Some('"') {
            return Err(format!("line {start_line}: malformed raw string literal"));
        }
        let mut text = String::new();
        loop {
            match self.bump() {
                None => {
                    return Err(format!(
                        "line {start_line}: unterminated raw string literal"
                    ))
                }
                Some('"') if (0..hashes).all(|k| self.peek(k) == Some('#')) => {
                    for _ in 0..hashes {
                        self.bump();
                    }
                    return Ok(text);
                }
                Some(c) => text.push(c),
            }
        }
    }

    /// At a `'`: a character literal (`'a'`, `'\n'`, `'\u{1F600}'`) or a lifetime / label
    /// (`'a`, `'static`).
    fn quote(&mut self) {
        self.bump(); // '
        match (self.peek(0), self.peek(1)) {
            (Some('\\'), _) => {
                // An escaped character literal: up to the closing quote.
                self.bump();
                self.bump();
                while let Some(c) = self.bump() {
                    if c == '\'' || c == '\n' {
                        break;
                    }
                }
            }
            (Some(_), Some('\'')) => {
                self.bump();
                self.bump();
            }
            _ => {
                while self.peek(0).is_some_and(is_ident_continue) {
                    self.bump();
                }
            }
        }
    }

    fn block_comment(&mut self, start_line: u32) -> Result<(), String> {
        self.bump();
        self.bump(); // /*
        let mut depth = 1;
        while depth > 0 {
            match (self.bump(), self.peek(0)) {
                (None, _) => return Err(format!("line {start_line}: unterminated block comment")),
                (Some('/'), Some('*')) => {
                    self.bump();
                    depth += 1;
                }
                (Some('*'), Some('/')) => {
                    self.bump();
                    depth -= 1;
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Tokenize Rust source. Fails only on an unterminated string or comment.
pub fn lex(src: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = src.chars().collect();
    let mut l = Lexer {
        s: &chars,
        i: 0,
        line: 1,
    };
    let mut out = Vec::new();
    // A shebang line (`#!` not followed by `[`) is no token.
    if l.peek(0) == Some('#') && l.peek(1) == Some('!') && l.peek(2) != Some('[') {
        while l.peek(0).is_some_and(|c| c != '\n') {
            l.bump();
        }
    }
    while let Some(c) = l.peek(0) {
        let line = l.line;
        let mut push = |tok| out.push(Token { tok, line });
        if c.is_whitespace() {
            l.bump();
        } else if c == '/' && l.peek(1) == Some('/') {
            while l.peek(0).is_some_and(|c| c != '\n') {
                l.bump();
            }
        } else if c == '/' && l.peek(1) == Some('*') {
            l.block_comment(line)?;
        } else if c == '"' {
            l.bump();
            let s = l.quoted(line)?;
            push(Tok::Str(s));
        } else if c == '\'' {
            l.quote();
            push(Tok::Other);
        } else if is_ident_start(c) {
            // String and character prefixes: b"", b'', br"", r"", r#""#, c"", cr"".
            let (p1, p2) = (l.peek(1), l.peek(2));
            let raw_after = |k: usize| {
                matches!(l.peek(k), Some('"'))
                    || (l.peek(k) == Some('#') && matches!(l.peek(k + 1), Some('"') | Some('#')))
            };
            if (c == 'b' || c == 'c') && p1 == Some('"') {
                l.bump();
                l.bump();
                let s = l.quoted(line)?;
                push(Tok::Str(s));
            } else if c == 'b' && p1 == Some('\'') {
                l.bump();
                l.quote();
                push(Tok::Other);
            } else if (c == 'b' || c == 'c') && p1 == Some('r') && raw_after(2) {
                l.bump();
                l.bump();
                let s = l.raw_string(line)?;
                push(Tok::Str(s));
            } else if c == 'r' && raw_after(1) {
                l.bump();
                let s = l.raw_string(line)?;
                push(Tok::Str(s));
            } else if c == 'r' && p1 == Some('#') && p2.is_some_and(is_ident_start) {
                l.bump();
                l.bump();
                let mut name = String::new();
                while l.peek(0).is_some_and(is_ident_continue) {
                    name.push(l.bump().unwrap_or_default());
                }
                push(Tok::Ident { name, raw: true });
            } else {
                let mut name = String::new();
                while l.peek(0).is_some_and(is_ident_continue) {
                    name.push(l.bump().unwrap_or_default());
                }
                push(Tok::Ident { name, raw: false });
            }
        } else if c.is_ascii_digit() {
            // Digits, suffixes, `_`, hex letters; a `.` only when a digit follows (`1.5`, not
            // the `..` of `0..n` nor a method call on a literal).
            while let Some(d) = l.peek(0) {
                if is_ident_continue(d)
                    || (d == '.' && l.peek(1).is_some_and(|e| e.is_ascii_digit()))
                {
                    l.bump();
                } else {
                    break;
                }
            }
            push(Tok::Other);
        } else if c == ':' && l.peek(1) == Some(':') {
            l.bump();
            l.bump();
            push(Tok::PathSep);
        } else {
            l.bump();
            push(Tok::Punct(c));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idents(src: &str) -> Vec<String> {
        lex(src)
            .unwrap()
            .into_iter()
            .filter_map(|t| t.ident().map(str::to_string))
            .collect()
    }

    #[test]
    fn comments_and_literals_hide_their_content() {
        let src = r####"
            // crate::a line comment
            /* crate::b /* nested crate::c */ still comment crate::d */
            /// crate::doc
            let s = "crate::e \" crate::f";
            let r = r#"crate::g " crate::h"#;
            let r2 = r##"a "# crate::i"##;
            let b = b"crate::j"; let br = br#"crate::k"#; let c = c"crate::l";
            let ch = '"'; let q = '\''; let u = '\u{22}'; let bc = b'"';
            fn f<'a>(x: &'a str) -> &'a str { 'outer: loop { break 'outer; } x }
            kept
        "####;
        let ids = idents(src);
        assert!(!ids.iter().any(|i| i == "crate"), "{ids:?}");
        assert!(ids.contains(&"kept".to_string()), "{ids:?}");
        assert!(
            !ids.contains(&"outer".to_string()),
            "a label is no identifier: {ids:?}"
        );
    }

    #[test]
    fn lines_paths_and_raw_identifiers() {
        let t = lex("a\n\"x\ny\"\ncrate::r#mod::b").unwrap();
        assert_eq!(t[0].line, 1);
        assert_eq!(t[1].tok, Tok::Str("x\ny".into()));
        assert_eq!(t[2].line, 4);
        assert!(t[2].is_kw("crate"));
        assert_eq!(t[3].tok, Tok::PathSep);
        assert_eq!(
            t[4].tok,
            Tok::Ident {
                name: "mod".into(),
                raw: true
            }
        );
        assert!(!t[4].is_kw("mod"));
        assert_eq!(t[6].ident(), Some("b"));
    }

    #[test]
    fn numbers_do_not_swallow_ranges() {
        let t = lex("0..n 1.5 0x1F_u32 1e-3").unwrap();
        assert_eq!(t[0].tok, Tok::Other);
        assert!(t[1].is_punct('.') && t[2].is_punct('.'));
        assert_eq!(t[3].ident(), Some("n"));
    }

    #[test]
    fn unterminated_literals_are_errors() {
        assert!(lex("let s = \"abc").unwrap_err().contains("line 1"));
        assert!(lex("a\n/* x").unwrap_err().contains("line 2"));
    }
}
