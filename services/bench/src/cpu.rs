//! CPU time of the processes the bench measures, read from `/proc`, threads that have
//! ended included.
//!
//! A process's threads each have their run time in `/proc/<pid>/task/<tid>/schedstat`, in
//! nanoseconds; the process-wide figure of `/proc/<pid>/stat` counts threads that ended
//! too, but in clock ticks (10 ms), too coarse for the shorter figures. Summing the live
//! threads alone loses all the CPU of a thread that ends inside the window (tokio ends a
//! blocking-pool thread after 10 s idle, say), so a meter remembers each thread's last
//! value and keeps counting it after the thread is gone. A thread of the bench looks at
//! the processes every [`LOOK_EVERY`] meanwhile, so that a thread is seen shortly before
//! it ends.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::Context;

/// How often a meter looks at its processes' threads between reads. A thread's CPU is
/// known up to the last look before it ends; the threads that come and go in the servers
/// are tokio's blocking ones, which idle 10 s before they end, so next to nothing is lost.
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// CPU time used by some processes: the sum of the run time of every thread they have had
/// since the meter started, each at its last value seen. Take deltas of [`CpuMeter::now`]
/// with `saturating_sub`.
pub(crate) struct CpuMeter {
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    looker: Option<thread::JoinHandle<()>>,
}

impl CpuMeter {
    /// Starts metering `pids`: looks at their threads now, then every [`LOOK_EVERY`]
    /// until dropped. Fails if a process is not there.
    pub fn start(pids: &[u32]) -> anyhow::Result<Self> {
        let mut seen = Seen {
            pids: pids.to_vec(),
            ..Seen::default()
        };
        seen.look()?;
        let seen = Arc::new(Mutex::new(seen));
        let stop = Arc::new(AtomicBool::new(false));
        let looker = thread::Builder::new().name("cpu-meter".into()).spawn({
            let (seen, stop) = (seen.clone(), stop.clone());
            move || {
                loop {
                    thread::park_timeout(LOOK_EVERY);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // A process that has exited fails here; the next `now` says so.
                    let _ = seen.lock().unwrap_or_else(|e| e.into_inner()).look();
                }
            }
        })?;
        Ok(Self {
            seen,
            stop,
            looker: Some(looker),
        })
    }

    /// CPU time the processes have used so far (to nanoseconds), threads that ended
    /// counted at their last value seen. Fails if a process has exited.
    pub fn now(&self) -> anyhow::Result<Duration> {
        let total = self.seen.lock().unwrap_or_else(|e| e.into_inner()).look()?;
        Ok(Duration::from_nanos(total))
    }
}

impl Drop for CpuMeter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(looker) = self.looker.take() {
            looker.thread().unpark();
            let _ = looker.join();
        }
    }
}

/// What a meter has seen of its processes' threads.
#[derive(Default)]
struct Seen {
    pids: Vec<u32>,
    /// Each thread's run time as last seen, in nanoseconds, by process and thread id;
    /// a thread that ended keeps its entry.
    threads: HashMap<(u32, u32), u64>,
    /// Run time of ended threads whose id a later thread took.
    reused: u64,
}

impl Seen {
    /// Reads every live thread's run time; returns the total over all threads seen.
    fn look(&mut self) -> anyhow::Result<u64> {
        for &pid in &self.pids {
            for task in std::fs::read_dir(format!("/proc/{pid}/task"))
                .with_context(|| format!("process {pid} has exited"))?
            {
                let task = task?;
                let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
                    continue;
                };
                // A thread may end between listing and reading: its last value stays.
                let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
                    continue;
                };
                let ran: u64 = stat
                    .split_whitespace()
                    .next()
                    .context("malformed schedstat")?
                    .parse()?;
                let last = self.threads.entry((pid, tid)).or_default();
                if ran < *last {
                    // Run time only grows: this is a new thread with an ended one's id.
                    self.reused += *last;
                }
                *last = ran;
            }
        }
        Ok(self.reused + self.threads.values().sum::<u64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run time of the calling thread so far.
    fn own_run_time() -> Duration {
        let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
        Duration::from_nanos(stat.split_whitespace().next().unwrap().parse().unwrap())
    }

    #[test]
    fn a_thread_that_ended_still_counts() {
        const BURN: Duration = Duration::from_millis(200);
        let meter = CpuMeter::start(&[std::process::id()]).unwrap();
        let before = meter.now().unwrap();
        let (burnt, end) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let burner = thread::spawn(move || {
            let mut x = 0u64;
            while own_run_time() < BURN {
                for _ in 0..100_000 {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            burnt.0.send(()).unwrap();
            let _ = end.1.recv();
        });
        burnt.1.recv().unwrap();
        // Seen alive once, then gone before the last read.
        meter.now().unwrap();
        end.0.send(()).unwrap();
        burner.join().unwrap();
        let used = meter.now().unwrap().saturating_sub(before);
        assert!(used >= BURN, "the ended thread's CPU is lost: {used:?}");
    }
}
