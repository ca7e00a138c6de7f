//! Progress of long hardware runs (`test-hw`, `bench-hw`).
//!
//! On a terminal: one status line on stderr, redrawn in place (`[3/41] vmm_map_unmap  12.4 s`),
//! with the children's output scrolling above it. Otherwise (logs, CI, a pipe): a plain line per
//! step, `[3/41] vmm_map_unmap …` when it starts and `[3/41] vmm_map_unmap ok (0.8 s)` when it
//! ends, so a log says what ran and for how long.

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::Result;

struct Status {
    step: usize,
    total: usize,
    name: String,
    step_started: Instant,
    started: Instant,
    /// Whether a status line is on the terminal now.
    drawn: bool,
}

impl Status {
    fn line(&self) -> String {
        format!(
            "[{}/{}] {}  {:.1} s (total {:.0} s)",
            self.step,
            self.total,
            self.name,
            self.step_started.elapsed().as_secs_f64(),
            self.started.elapsed().as_secs_f64()
        )
    }
}

/// A progress display for `total` steps.
pub struct Progress {
    tty: bool,
    status: Arc<Mutex<Status>>,
    ticker: Option<(mpsc::Sender<()>, std::thread::JoinHandle<()>)>,
}

fn lock(s: &Mutex<Status>) -> std::sync::MutexGuard<'_, Status> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Clear the status line (terminal form).
fn clear(st: &mut Status) {
    if st.drawn {
        eprint!("\r\x1b[2K");
        st.drawn = false;
    }
}

fn draw(st: &mut Status) {
    let width = 160;
    let mut l = st.line();
    if l.chars().count() > width {
        l = l.chars().take(width).collect();
    }
    eprint!("\r\x1b[2K{l}");
    let _ = std::io::stderr().flush();
    st.drawn = true;
}

impl Progress {
    /// A display for `total` steps; the terminal form when stderr is a terminal.
    pub fn new(total: usize) -> Progress {
        Progress::with_terminal(total, std::io::stderr().is_terminal())
    }

    /// A display for `total` steps in the terminal form or the plain one.
    pub fn with_terminal(total: usize, tty: bool) -> Progress {
        let now = Instant::now();
        let status = Arc::new(Mutex::new(Status {
            step: 0,
            total,
            name: String::new(),
            step_started: now,
            started: now,
            drawn: false,
        }));
        let ticker = tty.then(|| {
            let (tx, rx) = mpsc::channel::<()>();
            let s = status.clone();
            let h = std::thread::spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) =
                    rx.recv_timeout(Duration::from_millis(250))
                {
                    let mut st = lock(&s);
                    if st.step > 0 {
                        draw(&mut st);
                    }
                }
            });
            (tx, h)
        });
        Progress {
            tty,
            status,
            ticker,
        }
    }

    /// The plain line that announces the current step.
    fn start_line(st: &Status) -> String {
        format!("[{}/{}] {} …", st.step, st.total, st.name)
    }

    /// Begin the next step, called `name`. More steps than announced grow the total.
    pub fn step(&self, name: &str) {
        let mut st = lock(&self.status);
        st.step += 1;
        st.total = st.total.max(st.step);
        st.name = name.to_string();
        st.step_started = Instant::now();
        if self.tty {
            draw(&mut st);
        } else {
            println!("{}", Progress::start_line(&st));
        }
    }

    /// The current step ended with `outcome` (ok, FAILED, ...): a plain line with its time.
    pub fn finish(&self, outcome: &str) {
        let mut st = lock(&self.status);
        if st.step == 0 {
            return;
        }
        let line = format!(
            "[{}/{}] {} {outcome} ({:.1} s)",
            st.step,
            st.total,
            st.name,
            st.step_started.elapsed().as_secs_f64()
        );
        if self.tty {
            clear(&mut st);
            eprintln!("{line}");
            draw(&mut st);
        } else {
            println!("{line}");
        }
    }

    /// Print a line of a child's output above the status line.
    pub fn println(&self, line: &str) {
        let mut st = lock(&self.status);
        if self.tty {
            clear(&mut st);
            println!("{line}");
            let _ = std::io::stdout().flush();
            if st.step > 0 {
                draw(&mut st);
            }
        } else {
            println!("{line}");
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some((tx, h)) = self.ticker.take() {
            let _ = tx.send(());
            let _ = h.join();
        }
        if self.tty {
            clear(&mut lock(&self.status));
        }
    }
}

/// Run `cmd`, passing each output line (stdout and stderr, as they come) through `progress` and
/// to `on_line`; return (success, the whole output) as [`crate::test_cmd::run_capture`] does.
pub fn run_with_progress(
    cmd: &mut Command,
    progress: &Progress,
    mut on_line: impl FnMut(&str),
) -> Result<(bool, String)> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let (tx, rx) = mpsc::channel::<String>();
    let pump = |r: Box<dyn Read + Send>, tx: mpsc::Sender<String>| {
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines() {
                let Ok(l) = line else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        })
    };
    let out = child.stdout.take().map(|o| pump(Box::new(o), tx.clone()));
    let err = child.stderr.take().map(|e| pump(Box::new(e), tx.clone()));
    drop(tx);
    let mut text = String::new();
    for line in rx {
        on_line(&line);
        progress.println(&line);
        text.push_str(&line);
        text.push('\n');
    }
    for h in [out, err].into_iter().flatten() {
        let _ = h.join();
    }
    let status = child.wait()?;
    Ok((status.success(), text))
}

/// The test name of a libtest line `test name ... ` (the start of a test with `--nocapture`,
/// or its whole report without).
pub fn libtest_start(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("test ")?;
    let (name, _) = rest.split_once(" ... ")?;
    Some(name.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtest_lines_name_the_test() {
        assert_eq!(libtest_start("test vmm::map ... ok"), Some("vmm::map"));
        assert_eq!(libtest_start("test vmm::map ... "), Some("vmm::map"));
        assert_eq!(libtest_start("test result: ok. 3 passed"), None);
        assert_eq!(libtest_start("running 3 tests"), None);
    }

    #[test]
    fn plain_progress_passes_output_through_and_counts_steps() {
        let p = Progress::with_terminal(2, false);
        p.step("one");
        let (ok, out) = run_with_progress(
            Command::new("sh").args(["-c", "echo a; echo b >&2"]),
            &p,
            |_| {},
        )
        .unwrap();
        p.finish("ok");
        assert!(ok);
        let mut lines: Vec<&str> = out.lines().collect();
        lines.sort();
        assert_eq!(lines, ["a", "b"]);
    }
}
