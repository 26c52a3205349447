//! The MCP toolset against a small MCP server written for each test in Python: one that
//! behaves, and ones that misbehave (garbage on stdout, notifications before the
//! `initialize` answer, no answer at all, a crash mid-call).

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use serde_json::json;

use super::*;

/// A line-delimited JSON-RPC MCP server: `fake.py MODE STATE_DIR`.
const FAKE_SERVER: &str = r#"
import json, os, sys
mode, state = sys.argv[1], sys.argv[2]
with open(os.path.join(state, "pid"), "w") as f:
    f.write(str(os.getpid()))
if mode == "helper":
    # A process of its own it leaves running, as `npx` does its server.
    import subprocess
    helper = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(state, "helper.tmp"), "w") as f:
        f.write(str(helper.pid))
    os.replace(os.path.join(state, "helper.tmp"), os.path.join(state, "helper"))

if mode == "dies":
    # As node does for a script that is not there.
    sys.stderr.write("node:internal/modules/cjs/loader:1228\n  throw err;\n")
    sys.stderr.write("Error: Cannot find module '/nowhere/index.js'\n")
    sys.stderr.flush()
    sys.exit(1)
if mode == "stubborn":
    # Does not exit when its stdin closes; cleans up on SIGTERM.
    import signal
    def on_term(*_):
        open(os.path.join(state, "terminated"), "w").close()
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)

def send(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()

def tool(name):
    return {"name": name, "description": "the " + name + " tool",
            "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}

if mode == "silent":
    for line in sys.stdin:
        pass
    sys.exit(0)
if mode == "early":
    send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "hi"}})

extra = False
for line in sys.stdin:
    if mode == "garbage":
        sys.stdout.write("this is not JSON\n{\"half\": \n[1, 2]\n")
        sys.stdout.flush()
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    params = msg.get("params") or {}
    if method == "initialize":
        if mode == "early":
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": "2025-06-18",
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": "fake", "version": "1"}}})
    elif method == "tools/list":
        if mode == "relist-fails" and extra and not os.path.exists(os.path.join(state, "refused")):
            # The first listing after the change fails.
            open(os.path.join(state, "refused"), "w").close()
            send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32603, "message": "busy"}})
            continue
        # Mode `ttl`: lists a client may keep for five minutes (MCP 2026-07-28's `ttlMs`).
        ttl = {"ttlMs": 300000} if mode == "ttl" else {}
        if mode == "flood" and params.get("cursor") is not None:
            # Announces a change after every list, whole.
            with open(os.path.join(state, "lists"), "a") as f:
                f.write("x")
            send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [tool("crash")]}})
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
            continue
        if mode == "bulky":
            # A tool too large by itself, then pages of large tools: 12 MB in all.
            big = lambda name, size: {"name": name, "inputSchema": {
                "type": "object", "description": "x" * size}}
            cursor = params.get("cursor")
            if cursor is None:
                send({"jsonrpc": "2.0", "id": mid, "result": {
                    "tools": [tool("echo"), big("huge", 300000)], "nextCursor": "b1"}})
            else:
                n = int(cursor[1:])
                result = {"tools": [big("bulk%d_%d" % (n, i), 150000) for i in range(20)]}
                if n < 4:
                    result["nextCursor"] = "b%d" % (n + 1)
                send({"jsonrpc": "2.0", "id": mid, "result": result})
            continue
        if params.get("cursor") is None:
            # Mode `unreadable`: a cursor that is a number, as no SDK reads it.
            cursor = 2 if mode == "unreadable" else "page-2"
            send({"jsonrpc": "2.0", "id": mid, "result": dict({
                "tools": [tool("echo"), tool("slow")], "nextCursor": cursor}, **ttl)})
        elif mode == "page-refused" or (mode == "page-refused-later" and extra):
            open(os.path.join(state, "refused"), "w").close()
            send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32602, "message": "Invalid cursor"}})
        else:
            tools = [tool("crash"), tool("change"), tool("fail"), tool("odd.name"), tool("meta")]
            if extra:
                tools.append(tool("added"))
            if mode == "tasks":
                # Tools of MCP 2025-11-25 that can only be called as tasks, or either way.
                tools.append(dict(tool("research"), execution={"taskSupport": "required"}))
                tools.append(dict(tool("either"), execution={"taskSupport": "optional"}))
                # A tool listed without the inputSchema MCP requires.
                tools.append({"name": "bare", "description": "takes nothing"})
            if mode == "unreadable":
                # A hint that is no boolean, icons of a theme MCP does not know; a tool
                # without a name, one whose name is a number.
                tools.append(dict(tool("hinted"), annotations={"readOnlyHint": "yes"},
                                  icons=[{"src": "x.png", "theme": "sepia"}]))
                tools.append({"inputSchema": {"type": "object"}})
                tools.append({"name": 5, "inputSchema": {"type": "object"}})
            if mode == "collide":
                # `odd.name` and `odd_name` are both offered as `fake__odd_name`; a tool
                # whose arguments could never be an object.
                tools.append(tool("odd_name"))
                tools.append({"name": "list", "inputSchema": {"type": "array"}})
            send({"jsonrpc": "2.0", "id": mid, "result": dict({"tools": tools}, **ttl)})
    elif method == "tools/call":
        name, args = params["name"], params.get("arguments") or {}
        if name == "echo":
            send({"jsonrpc": "2.0", "id": mid, "result": {
                "content": [{"type": "text", "text": args.get("text", "")}],
                "structuredContent": {"echo": args.get("text")}}})
        elif name == "meta":
            send({"jsonrpc": "2.0", "id": mid, "result": {
                "content": [{"type": "text", "text": json.dumps(params.get("_meta"))}]}})
        elif name == "big":
            send({"jsonrpc": "2.0", "id": mid, "result": {
                "content": [{"type": "text", "text": "A" * args["n"]}]}})
        elif name == "big_id_last":
            # As the TypeScript SDK writes answers: the id last.
            send({"result": {"content": [{"type": "text", "text": "A" * args["n"]}]},
                  "jsonrpc": "2.0", "id": mid})
        elif name == "fail":
            send({"jsonrpc": "2.0", "id": mid, "result": {
                "content": [{"type": "text", "text": "it failed"}], "isError": True}})
        elif name == "video":
            # A content type from a later protocol version, and one the client knows.
            send({"jsonrpc": "2.0", "id": mid, "result": {
                "content": [{"type": "text", "text": "before"},
                            {"type": "video", "uri": "test://v", "mimeType": "video/mp4"},
                            {"type": "audio", "data": "AAAA", "mimeType": "audio/wav"},
                            {"type": "image", "data": "AAAA"},
                            {"type": "text", "text": "after"}],
                "structuredContent": {"frames": 3}}})
        elif name == "slow":
            pass
        elif name == "nap":
            # Works for a while, answering nothing else meanwhile (as a server that
            # serves a call at a time does).
            import time
            time.sleep(args["seconds"])
            send({"jsonrpc": "2.0", "id": mid, "result": {
                "content": [{"type": "text", "text": "done"}]}})
        elif name == "hang":
            # Stops answering anything at all.
            import time
            time.sleep(3600)
        elif name == "crash":
            os._exit(3)
        elif name == "change":
            extra = True
            send({"jsonrpc": "2.0", "id": mid, "result": {"content": []}})
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        else:
            send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32602, "message": "no tool " + name}})
    elif method == "notifications/cancelled":
        with open(os.path.join(state, "cancelled"), "a") as f:
            f.write(json.dumps(params) + "\n")
    elif method == "ping" and mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
if mode == "stubborn":
    import time
    while True:
        time.sleep(1)
"#;

struct Fake {
    dir: PathBuf,
}

impl Fake {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "agentrt-mcp-{test}-{}-{}",
            std::process::id(),
            unique_suffix()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("fake.py"), FAKE_SERVER).unwrap();
        Self { dir }
    }

    fn config(&self, mode: &str) -> McpServerConfig {
        McpServerConfig {
            name: "fake".into(),
            command: Some("python3".into()),
            args: vec![
                self.dir.join("fake.py").display().to_string(),
                mode.into(),
                self.dir.display().to_string(),
            ],
            env: BTreeMap::new(),
            cwd: None,
            url: None,
            headers: BTreeMap::new(),
            query: BTreeMap::new(),
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            max_output_bytes: default_max_output_bytes(),
            max_message_bytes: default_max_message_bytes(),
        }
    }

    fn pid(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// The pid of the process the server (mode `helper`) started.
    fn helper(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("helper"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    fn cancelled(&self) -> String {
        std::fs::read_to_string(self.dir.join("cancelled")).unwrap_or_default()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn unique_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
}

fn alive(pid: u32) -> bool {
    // A zombie still has a /proc entry; its state is `Z`.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| !stat.contains(") Z "))
        .unwrap_or(false)
}

async fn names(toolset: &McpToolset) -> Vec<String> {
    toolset
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.spec.name)
        .collect()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A tool larger than a tool may be is left out, and a server's tools past its share of
/// the catalogue are too: one server does not make `ListTools` fail for every caller.
#[tokio::test]
async fn a_servers_tools_are_bounded_in_bytes() {
    let fake = Fake::new("bulky");
    let toolset = McpToolset::start(fake.config("bulky"), Changes::new())
        .await
        .unwrap();
    let names = names(&toolset).await;
    assert_eq!(names[0], "fake__echo");
    assert!(!names.contains(&"fake__huge".to_owned()), "{names:?}");
    let bulk = names.iter().filter(|n| n.starts_with("fake__bulk")).count();
    // 8 MiB of tools of 150 KB each.
    assert!((50..=56).contains(&bulk), "{bulk} bulky tools listed");
    let listed: usize = toolset
        .list()
        .await
        .unwrap()
        .iter()
        .map(|t| t.spec.input_schema.to_string().len())
        .sum();
    assert!(listed <= MAX_LISTED_BYTES, "{listed}");
}

/// A server that announces a change after every list is asked for it at most once a
/// second, not on end.
#[tokio::test]
async fn a_flood_of_list_changes_is_listed_once_a_second() {
    let fake = Fake::new("flood");
    let toolset = McpToolset::start(fake.config("flood"), Changes::new())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let lists = std::fs::read_to_string(fake.dir.join("lists"))
        .unwrap_or_default()
        .len();
    assert!((2..=5).contains(&lists), "listed {lists} times in 3 s");
    assert_eq!(
        names(&toolset).await,
        ["fake__echo", "fake__slow", "fake__crash"]
    );
}

/// The tools the fake server lists over its two pages, as offered.
const GOOD_TOOLS: [&str; 7] = [
    "fake__echo",
    "fake__slow",
    "fake__crash",
    "fake__change",
    "fake__fail",
    "fake__odd_name",
    "fake__meta",
];

/// A tool the SDK cannot read, or a later page the server refuses, leaves out that
/// tool or the pages after it, not every tool of the server (which was kept offline,
/// started again and again).
#[tokio::test]
async fn unreadable_tools_and_refused_pages_leave_out_only_themselves() {
    let fake = Fake::new("unreadable");
    let toolset = McpToolset::start(fake.config("unreadable"), Changes::new())
        .await
        .unwrap();
    assert_eq!(
        names(&toolset).await,
        [&GOOD_TOOLS[..], &["fake__hinted"]].concat()
    );
    let out = toolset
        .call("echo", json!({"text": "hi"}), &ToolContext::default())
        .await
        .unwrap();
    assert_eq!(out.text, "hi");

    let fake = Fake::new("page-refused");
    let toolset = McpToolset::start(fake.config("page-refused"), Changes::new())
        .await
        .unwrap();
    assert_eq!(names(&toolset).await, ["fake__echo", "fake__slow"]);
}

#[tokio::test]
async fn a_page_refused_on_a_later_list_keeps_the_list_before() {
    let fake = Fake::new("page-refused-later");
    let toolset = McpToolset::start(fake.config("page-refused-later"), Changes::new())
        .await
        .unwrap();
    assert_eq!(names(&toolset).await, GOOD_TOOLS);
    // Announces a change; its second page is refused from then on.
    let out = toolset
        .call("change", json!({}), &ToolContext::default())
        .await
        .unwrap();
    assert!(!out.is_error, "{}", out.text);
    eventually("the second page refused", || {
        fake.dir.join("refused").exists()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(names(&toolset).await, GOOD_TOOLS);
}

#[tokio::test]
async fn lists_every_page_calls_and_maps_results() {
    let fake = Fake::new("good");
    let toolset = McpToolset::start(fake.config("good"), Changes::new())
        .await
        .unwrap();
    assert_eq!(names(&toolset).await, GOOD_TOOLS);
    let listed = toolset.list().await.unwrap();
    assert_eq!(listed[5].source_name, "odd.name");
    assert_eq!(listed[0].spec.source, ToolSource::Mcp);
    assert_eq!(listed[0].spec.input_schema["type"], "object");

    let ctx = ToolContext::default();
    let out = toolset
        .call("echo", json!({"text": "hi"}), &ctx)
        .await
        .unwrap();
    assert_eq!(out.text, "hi");
    assert_eq!(out.structured, Some(json!({"echo": "hi"})));
    assert!(!out.is_error);
    let out = toolset.call("fail", json!({}), &ctx).await.unwrap();
    assert!(out.is_error);
    assert_eq!(out.text, "it failed");
    let out = toolset.call("odd.name", json!({}), &ctx).await.unwrap();
    assert!(out.is_error);
    assert!(out.text.contains("no tool odd.name"), "{}", out.text);

    // The call's id goes with it as its idempotency key (a call sent again after a
    // take-over carries the same one); a call without an id carries none.
    let out = toolset.call("meta", json!({}), &ctx).await.unwrap();
    let meta: serde_json::Value = serde_json::from_str(&out.text).unwrap();
    assert!(meta.get(IDEMPOTENCY_META).is_none(), "{meta}");
    let with_id = ToolContext {
        call_id: "call_7".into(),
        ..ToolContext::default()
    };
    let out = toolset.call("meta", json!({}), &with_id).await.unwrap();
    let meta: serde_json::Value = serde_json::from_str(&out.text).unwrap();
    assert_eq!(meta[IDEMPOTENCY_META], "call_7", "{meta}");

    let pid = fake.pid();
    assert!(alive(pid));
    toolset.shutdown().await;
    assert!(!alive(pid), "the child process is stopped on shutdown");
    let err = toolset.call("echo", json!({}), &ctx).await.unwrap_err();
    assert!(matches!(err, CallError::Unavailable { .. }), "{err:?}");
}

/// A toolset of `fake` in `mode` whose tool `change` was called: the server added a tool
/// and sent `notifications/tools/list_changed`.
async fn changed(fake: &Fake, mode: &str) -> (McpToolset, Changes) {
    let changes = Changes::new();
    let toolset = McpToolset::start(fake.config(mode), changes.clone())
        .await
        .unwrap();
    // The first listing signalled a change already; take it.
    tokio::time::timeout(Duration::from_secs(1), changes.changed())
        .await
        .unwrap();
    toolset
        .call("change", json!({}), &ToolContext::default())
        .await
        .unwrap();
    (toolset, changes)
}

#[tokio::test]
async fn a_list_change_refreshes_the_tools() {
    let fake = Fake::new("change");
    let (toolset, changes) = changed(&fake, "good").await;
    tokio::time::timeout(Duration::from_secs(5), changes.changed())
        .await
        .expect("the catalogue is told of the change");
    assert!(names(&toolset).await.contains(&"fake__added".to_owned()));
    toolset.shutdown().await;
}

/// A listing asked for by `list_changed` that fails is asked for again: the new tools
/// are found without another change.
#[tokio::test]
async fn a_failed_listing_after_a_change_is_asked_for_again() {
    let fake = Fake::new("relist");
    let (toolset, changes) = changed(&fake, "relist-fails").await;
    eventually("the refused listing", || fake.dir.join("refused").exists()).await;
    tokio::time::timeout(Duration::from_secs(8), changes.changed())
        .await
        .expect("the listing is asked for again, and the catalogue told");
    assert!(names(&toolset).await.contains(&"fake__added".to_owned()));
    toolset.shutdown().await;
}

#[tokio::test]
async fn abandoned_and_timed_out_calls_are_cancelled_at_the_server() {
    let fake = Fake::new("cancel");
    let mut config = fake.config("good");
    config.timeout = Duration::from_millis(300);
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();

    let out = toolset
        .call("slow", json!({}), &ToolContext::default())
        .await
        .unwrap();
    assert!(out.is_error && out.timed_out);
    assert!(out.text.contains("did not finish"), "{}", out.text);
    eventually("the timeout's notifications/cancelled", || {
        fake.cancelled().lines().count() == 1
    })
    .await;

    let ctx = ToolContext::default();
    let cancel = ctx.cancel.clone();
    let call = toolset.call("slow", json!({}), &ctx);
    let (out, ()) = tokio::join!(call, async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        cancel.cancel();
    });
    assert!(out.unwrap().is_error);
    eventually("the caller's notifications/cancelled", || {
        fake.cancelled().lines().count() == 2
    })
    .await;
    // A call dropped by its caller (a gRPC deadline) is cancelled too.
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        toolset.call("slow", json!({}), &ToolContext::default()),
    )
    .await;
    assert!(dropped.is_err());
    eventually("the dropped call's notifications/cancelled", || {
        fake.cancelled().lines().count() == 3
    })
    .await;
    let ids: Vec<serde_json::Value> = fake
        .cancelled()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["requestId"].clone())
        .collect();
    assert!(ids.iter().all(|id| !id.is_null()), "{ids:?}");
    // The server still answers.
    let out = toolset
        .call(
            "echo",
            json!({"text": "still here"}),
            &ToolContext::default(),
        )
        .await
        .unwrap();
    assert_eq!(out.text, "still here");
    toolset.shutdown().await;
}

/// A server that exits before it answers `initialize` is down for a reason that says
/// how it exited and what it wrote last on stderr.
#[tokio::test]
async fn a_server_that_exits_at_start_says_why() {
    let fake = Fake::new("dies");
    let toolset = McpToolset::start(fake.config("dies"), Changes::new())
        .await
        .unwrap();
    let err = toolset
        .call("echo", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    let CallError::Unavailable { reason, .. } = &err else {
        panic!("{err:?}");
    };
    assert!(reason.contains("exited (exit status: 1)"), "{reason}");
    assert!(
        reason.contains("stderr: Error: Cannot find module '/nowhere/index.js'"),
        "{reason}"
    );
    toolset.shutdown().await;
}

#[tokio::test]
async fn a_crashed_server_is_unavailable_then_restarted() {
    let fake = Fake::new("crash");
    let toolset = McpToolset::start(fake.config("good"), Changes::new())
        .await
        .unwrap();
    let first = fake.pid();
    let err = toolset
        .call("crash", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    let CallError::Unavailable {
        source_name,
        reason,
        retry_after,
        sent,
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!(source_name, "fake");
    assert!(reason.contains("\"fake\""), "{reason}");
    assert!(*retry_after <= Duration::from_secs(1), "{retry_after:?}");
    assert!(*sent, "the call reached the server: it may have run");
    // Meanwhile calls are refused at once, naming the server, saying when it is tried
    // again; the tools stay listed.
    let err = toolset
        .call("echo", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    let CallError::Unavailable {
        retry_after, sent, ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert!(*retry_after <= RETRY_WHILE_CONNECTING, "{retry_after:?}");
    assert!(!*sent, "the call was not sent: the server is down");
    assert_eq!(names(&toolset).await.len(), 7);
    eventually("the restart", || {
        toolset.is_connected() && fake.pid() != first
    })
    .await;
    // The failed call's report of its connection is not taken for one about the new
    // connection: that one stays up (it was once dropped at once, and its child with it).
    let second = fake.pid();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        toolset.is_connected() && fake.pid() == second && alive(second),
        "the new connection was dropped"
    );
    let out = toolset
        .call("echo", json!({"text": "back"}), &ToolContext::default())
        .await
        .unwrap();
    assert_eq!(out.text, "back");
    toolset.shutdown().await;
}

/// What a server started (`npx` starts the server itself; a server may start helpers)
/// stops with it: when it crashes, and when the toolset stops.
#[tokio::test]
async fn what_a_server_started_stops_with_it() {
    let fake = Fake::new("helper");
    let toolset = McpToolset::start(fake.config("helper"), Changes::new())
        .await
        .unwrap();
    let first = fake.helper();
    assert!(alive(first));
    toolset
        .call("crash", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    eventually("the crashed server's helper to stop", || !alive(first)).await;
    eventually("the restart", || {
        toolset.is_connected() && fake.helper() != first
    })
    .await;
    let second = fake.helper();
    assert!(alive(second));
    toolset.shutdown().await;
    eventually("the helper to stop with the toolset", || !alive(second)).await;
}

#[tokio::test]
async fn a_server_that_outlives_its_stdin_is_sent_sigterm_before_it_is_killed() {
    let fake = Fake::new("stubborn");
    let toolset = McpToolset::start(fake.config("stubborn"), Changes::new())
        .await
        .unwrap();
    let pid = fake.pid();
    toolset.shutdown().await;
    assert!(fake.dir.join("terminated").exists(), "no SIGTERM");
    assert!(!alive(pid));
}

#[tokio::test]
async fn misbehaving_servers_neither_hang_nor_crash_the_executor() {
    // Garbage on stdout, and notifications before the `initialize` answer: both ignored.
    for mode in ["garbage", "early"] {
        let fake = Fake::new(mode);
        let toolset = McpToolset::start(fake.config(mode), Changes::new())
            .await
            .unwrap();
        assert_eq!(names(&toolset).await.len(), 7, "{mode}");
        let out = toolset
            .call("echo", json!({"text": mode}), &ToolContext::default())
            .await
            .unwrap();
        assert_eq!(out.text, mode);
        toolset.shutdown().await;
    }

    // A server that never answers: start-up waits at most `connect_timeout`, its tools
    // are unknown, and a call says why.
    let fake = Fake::new("silent");
    let mut config = fake.config("silent");
    config.connect_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(names(&toolset).await.is_empty());
    let err = toolset
        .call("echo", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("within 500ms"), "{err}");
    toolset.shutdown().await;

    // A command that does not exist.
    let mut config = fake.config("good");
    config.command = Some("/nonexistent/mcp-server".into());
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    let err = toolset
        .call("echo", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cannot start"), "{err}");
    toolset.shutdown().await;

    // A working directory that does not exist is named, not taken for a missing command.
    let mut config = fake.config("good");
    config.cwd = Some("/nonexistent/dir".into());
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    let err = toolset
        .call("echo", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("working directory (cwd) \"/nonexistent/dir\" is not a directory"),
        "{err}"
    );
    toolset.shutdown().await;
}

#[test]
fn configs_are_checked() {
    let fake = Fake::new("config");
    let good = fake.config("good");
    assert_eq!(good.check(), Ok(()));
    let mut both = good.clone();
    both.url = Some("http://127.0.0.1:1/mcp".into());
    assert!(both.check().is_err());
    let mut neither = good.clone();
    neither.command = None;
    assert!(neither.check().is_err());
    let mut bad_name = good.clone();
    bad_name.name = "9lives".into();
    assert!(bad_name.check().unwrap_err().contains("letter"));
    // Headers the transport sets itself are refused at start, not at every request.
    let mut http = good;
    http.command = None;
    http.url = Some("http://127.0.0.1:1/mcp".into());
    http.args.clear();
    let secret = crate::secret::SecretRef {
        env: Some("PATH".into()),
        file: None,
        prefix: String::new(),
    };
    http.headers.insert("X-Api-Key".into(), secret.clone());
    assert_eq!(http.check(), Ok(()));
    http.headers.insert("Mcp-Session-Id".into(), secret);
    assert!(
        http.check()
            .unwrap_err()
            .contains("\"Mcp-Session-Id\" is the MCP transport's own"),
    );
}

#[tokio::test]
async fn a_call_that_saw_its_connection_fail_leaves_the_next_connection_alone() {
    let fake = Fake::new("stale");
    let toolset = Arc::new(
        McpToolset::start(fake.config("good"), Changes::new())
            .await
            .unwrap(),
    );
    let first = fake.pid();
    let caller = toolset.clone();
    let call = tokio::spawn(async move {
        caller
            .call("slow", json!({}), &ToolContext::default())
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &first.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let err = call.await.unwrap().unwrap_err();
    assert!(matches!(err, CallError::Unavailable { .. }), "{err:?}");
    eventually("the restart", || {
        toolset.is_connected() && fake.pid() != first
    })
    .await;
    let second = fake.pid();
    // A call on the first connection reports its failure late, after the server was
    // connected again (as one did, 6 ms after a restart): the new connection stays.
    toolset.shared.failed_connection.store(1, Ordering::Release);
    toolset.shared.reconnect.notify_one();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        toolset.is_connected() && fake.pid() == second && alive(second),
        "the new connection was dropped for the old one's failure"
    );
    toolset.shutdown().await;
}

#[tokio::test]
async fn one_servers_clashing_names_and_non_object_schemas_leave_tools_out_not_the_start() {
    let fake = Fake::new("collide");
    let changes = Changes::new();
    let toolset = Arc::new(
        McpToolset::start(fake.config("collide"), changes.clone())
            .await
            .unwrap(),
    );
    assert!(toolset.is_connected(), "the server is up at start");
    let catalogue = crate::Catalogue::new(vec![toolset.clone() as Arc<dyn Toolset>], changes)
        .await
        .expect("one server's clashing tools do not stop the start");
    let names: Vec<String> = catalogue.specs().into_iter().map(|s| s.name).collect();
    assert_eq!(
        names.iter().filter(|n| *n == "fake__odd_name").count(),
        1,
        "{names:?}"
    );
    assert!(!names.contains(&"fake__list".to_owned()), "{names:?}");
    assert!(names.contains(&"fake__echo".to_owned()), "{names:?}");
    // The one kept is the one listed first, `odd.name`: the fake answers it is unknown.
    let out = catalogue
        .execute("fake__odd_name", json!({}), &ToolContext::default())
        .await
        .unwrap();
    assert!(out.text.contains("no tool odd.name"), "{}", out.text);
    toolset.shutdown().await;
}

#[tokio::test]
async fn an_answer_over_max_message_bytes_is_a_prompt_error_naming_the_bound() {
    let fake = Fake::new("big");
    let mut config = fake.config("good");
    config.max_message_bytes = 64 * 1024;
    config.timeout = Duration::from_secs(30);
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    let pid = fake.pid();
    for tool in ["big", "big_id_last"] {
        let started = Instant::now();
        let out = toolset
            .call(tool, json!({"n": 200_000}), &ToolContext::default())
            .await
            .unwrap();
        assert!(out.is_error, "{tool}: {}", out.text);
        assert!(
            out.text
                .contains("larger than `max_message_bytes` (65536 bytes)"),
            "{tool}: {}",
            out.text
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{tool}: the call waited {:?}",
            started.elapsed()
        );
    }
    // An answer within the bound still comes through, on the same connection.
    let out = toolset
        .call("big", json!({"n": 1000}), &ToolContext::default())
        .await
        .unwrap();
    assert!(!out.is_error && out.text.len() == 1000, "{}", out.text);
    assert_eq!(fake.pid(), pid, "the server was not restarted");
    toolset.shutdown().await;
}

/// A streamable HTTP MCP server: `http_fake.py MODE [502]` (`json` or `sse` answers) prints
/// its port, then serves `big` (an answer of `n` bytes of text), `video` (content of a type
/// the client does not know), `bad_gateway` (answered HTTP 502, as a proxy in front of a
/// server that is down does) and `restart` (forgets every session, as a server restarted
/// behind the same URL: it then refuses them with a 400 as server-everything does, which
/// does not name the request). It
/// lists `research` too, a tool that can only be called as a task, and `nothing`, whose
/// schema is `{}`. It also serves `too_large` (answered HTTP 413 in HTML, as nginx answers a
/// body over its limit), `rate_limited` (HTTP 429, `Retry-After: 3`) and `slow` (answered
/// after `seconds`, 1 by default). With `serial`, it answers one `tools/list` or
/// `tools/call` at a time, as a server running a blocking tool on its one event loop does. With `502`, every request is answered HTTP 502; with `loop`, every
/// page of its tool list names the same `nextCursor`; with `key`, it refuses any request
/// whose URL lacks `?apiKey=sesame`.
const HTTP_FAKE_SERVER: &str = r#"
import json, sys, threading, time, uuid
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
from urllib.parse import urlparse, parse_qs
mode = sys.argv[1]
down = "502" in sys.argv[2:]
loop = "loop" in sys.argv[2:]
key = "key" in sys.argv[2:]
# As a server that runs a blocking tool on its one event loop: nothing else is answered
# until the call ends.
serial = "serial" in sys.argv[2:]
one_at_a_time = threading.Lock()
sessions = set()

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def empty(self, code):
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def body(self, code, ctype, body, headers={}):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def answer(self, obj, headers={}):
        if mode == "sse":
            self.body(200, "text/event-stream", ("event: message\ndata: " + json.dumps(obj) + "\n\n").encode(), headers)
        else:
            self.body(200, "application/json", json.dumps(obj).encode(), headers)
    def bad_gateway(self):
        self.body(502, "text/html", b"<html><body><h1>502 Bad Gateway</h1></body></html>")
    def do_GET(self):
        self.empty(405)
    def do_DELETE(self):
        self.empty(200)
    def do_POST(self):
        msg = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if down:
            return self.bad_gateway()
        if key and parse_qs(urlparse(self.path).query).get("apiKey") != ["sesame"]:
            return self.body(401, "text/plain", b"no key")
        method, mid = msg.get("method"), msg.get("id")
        if method != "initialize" and self.headers.get("Mcp-Session-Id") not in sessions:
            # As server-everything: 400, without the request's id.
            return self.body(400, "application/json", json.dumps({"jsonrpc": "2.0",
                "error": {"code": -32000, "message": "Bad Request: No valid session ID provided"}}).encode())
        if mid is None:
            return self.empty(202)
        if serial and method in ("tools/list", "tools/call"):
            with one_at_a_time:
                return self.serve(msg, method, mid)
        return self.serve(msg, method, mid)
    def serve(self, msg, method, mid):
        if method == "initialize":
            session = str(uuid.uuid4())
            sessions.add(session)
            return self.answer({"jsonrpc": "2.0", "id": mid, "result": {
                "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake", "version": "1"}}}, {"Mcp-Session-Id": session})
        if method == "tools/list":
            page = {"tools": [
                {"name": "big", "inputSchema": {"type": "object"}},
                {"name": "research", "inputSchema": {"type": "object"},
                 "execution": {"taskSupport": "required"}},
                {"name": "nothing", "inputSchema": {}},
                # Without the inputSchema MCP requires.
                {"name": "bare"}]}
            if loop:
                page["nextCursor"] = "again"
            return self.answer({"jsonrpc": "2.0", "id": mid, "result": page})
        if method == "tools/call":
            name, args = msg["params"]["name"], msg["params"].get("arguments") or {}
            if name == "bad_gateway":
                return self.bad_gateway()
            if name == "too_large":
                return self.body(413, "text/html", b"<html><h1>413 Request Entity Too Large</h1></html>")
            if name == "rate_limited":
                return self.body(429, "text/plain", b"slow down", {"Retry-After": "3"})
            if name == "slow":
                time.sleep(args.get("seconds", 1))
                return self.answer({"jsonrpc": "2.0", "id": mid, "result": {
                    "content": [{"type": "text", "text": "done"}]}})
            if name == "restart":
                sessions.clear()
                return self.answer({"jsonrpc": "2.0", "id": mid, "result": {
                    "content": [{"type": "text", "text": "restarted"}]}})
            if name == "video":
                return self.answer({"jsonrpc": "2.0", "id": mid, "result": {"content": [
                    {"type": "video", "uri": "test://v"}, {"type": "text", "text": "seen"}]}})
            return self.answer({"jsonrpc": "2.0", "id": mid, "result": {
                "content": [{"type": "text", "text": "B" * args["n"]}]}})
        self.answer({"jsonrpc": "2.0", "id": mid, "result": {}})

server = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

/// Starts `HTTP_FAKE_SERVER` with `args`; returns it (killed when dropped) and a config
/// for it.
async fn http_fake(fake: &Fake, args: &[&str]) -> (tokio::process::Child, McpServerConfig) {
    use tokio::io::AsyncBufReadExt;

    std::fs::write(fake.dir.join("http_fake.py"), HTTP_FAKE_SERVER).unwrap();
    let mut server = tokio::process::Command::new("python3")
        .arg(fake.dir.join("http_fake.py"))
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut port = String::new();
    tokio::io::BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut port)
        .await
        .unwrap();
    let mut config = fake.config("unused");
    config.command = None;
    config.args.clear();
    config.url = Some(format!("http://127.0.0.1:{}/mcp", port.trim()));
    (server, config)
}

/// Asserts that `message` is a sentence for people, not the SDK's types.
#[track_caller]
fn names_no_rust_types(message: &str) {
    for word in [
        "rmcp",
        "Transport",
        "Error",
        "::",
        "Some(",
        "Client(",
        "reqwest",
        "Http",
    ] {
        assert!(!message.contains(word), "{word:?} in {message:?}");
    }
}

#[tokio::test]
async fn an_http_answer_over_max_message_bytes_is_an_error_naming_the_bound() {
    let fake = Fake::new("http-big");
    for mode in ["json", "sse"] {
        let (mut server, mut config) = http_fake(&fake, &[mode]).await;
        config.max_message_bytes = 64 * 1024;
        config.timeout = Duration::from_secs(30);
        let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
        assert!(toolset.is_connected(), "{mode}");
        let connection = toolset.shared.state.read().unwrap().connection;
        let started = Instant::now();
        let out = toolset
            .call("big", json!({"n": 200_000}), &ToolContext::default())
            .await
            .expect("not UNAVAILABLE: trying again gets the same answer");
        assert!(out.is_error, "{mode}: {}", out.text);
        assert!(
            out.text
                .contains("larger than `max_message_bytes` (65536 bytes)"),
            "{mode}: {}",
            out.text
        );
        assert!(started.elapsed() < Duration::from_secs(5), "{mode}");
        let out = toolset
            .call("big", json!({"n": 1000}), &ToolContext::default())
            .await
            .unwrap();
        assert!(
            !out.is_error && out.text.len() == 1000,
            "{mode}: {}",
            out.text
        );
        assert_eq!(
            toolset.shared.state.read().unwrap().connection,
            connection,
            "{mode}: the session was kept"
        );
        toolset.shutdown().await;
        server.kill().await.unwrap();
    }
}

#[tokio::test]
async fn content_of_a_type_the_client_does_not_know_is_described_and_the_rest_kept() {
    let fake = Fake::new("video");
    let toolset = McpToolset::start(fake.config("good"), Changes::new())
        .await
        .unwrap();
    let out = toolset
        .call("video", json!({}), &ToolContext::default())
        .await
        .expect("the call succeeds");
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(
        out.text,
        "before\n[unsupported content type video]\n[audio: audio/wav, 3 bytes]\n\
         [unreadable image content]\nafter"
    );
    assert_eq!(out.structured, Some(json!({"frames": 3})));
    toolset.shutdown().await;

    for mode in ["json", "sse"] {
        let (mut server, config) = http_fake(&fake, &[mode]).await;
        let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
        let out = toolset
            .call("video", json!({}), &ToolContext::default())
            .await
            .unwrap();
        assert!(!out.is_error, "{mode}: {}", out.text);
        assert_eq!(out.text, "[unsupported content type video]\nseen", "{mode}");
        toolset.shutdown().await;
        server.kill().await.unwrap();
    }
}

#[tokio::test]
async fn tools_that_can_only_be_called_as_tasks_are_left_out() {
    let fake = Fake::new("tasks");
    let toolset = McpToolset::start(fake.config("tasks"), Changes::new())
        .await
        .unwrap();
    let listed = names(&toolset).await;
    assert!(!listed.contains(&"fake__research".to_owned()), "{listed:?}");
    assert!(listed.contains(&"fake__either".to_owned()), "{listed:?}");
    // A tool without inputSchema takes any object; it failed the server's whole listing.
    let bare = toolset
        .list()
        .await
        .unwrap()
        .into_iter()
        .find(|t| t.spec.name == "fake__bare")
        .expect("fake__bare is listed");
    assert_eq!(*bare.spec.input_schema, json!({"type": "object"}));
    assert_eq!(listed.len(), 9, "{listed:?}");
    toolset.shutdown().await;

    // Over streamable HTTP, answered as an event stream, and as a plain JSON body.
    for (mode, listed) in [
        ("sse", &["fake__big", "fake__nothing", "fake__bare"][..]),
        ("json", &["fake__big", "fake__nothing", "fake__bare"]),
    ] {
        let (mut server, config) = http_fake(&fake, &[mode]).await;
        let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
        assert_eq!(names(&toolset).await, listed, "{mode}");
        toolset.shutdown().await;
        server.kill().await.unwrap();
    }
}

#[tokio::test]
async fn an_http_502_is_unavailable_saying_so_in_words() {
    let fake = Fake::new("http-502");
    // A proxy answers 502 to a call: the server is down, for now.
    let (mut server, config) = http_fake(&fake, &["json"]).await;
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    assert!(toolset.is_connected());
    let err = toolset
        .call("bad_gateway", json!({}), &ToolContext::default())
        .await
        .unwrap_err();
    let CallError::Unavailable {
        source_name,
        reason,
        ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!(source_name, "fake");
    assert!(reason.contains("MCP server \"fake\""), "{reason}");
    assert!(reason.contains("HTTP 502"), "{reason}");
    names_no_rust_types(reason);
    toolset.shutdown().await;
    server.kill().await.unwrap();

    // A proxy answers 502 to everything: the server cannot be reached, and calls say why.
    let (mut server, config) = http_fake(&fake, &["json", "502"]).await;
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    assert!(!toolset.is_connected());
    let err = toolset
        .call("big", json!({"n": 1}), &ToolContext::default())
        .await
        .unwrap_err();
    let CallError::Unavailable { reason, .. } = &err else {
        panic!("{err:?}");
    };
    assert!(reason.contains("MCP server \"fake\""), "{reason}");
    assert!(reason.contains("HTTP 502"), "{reason}");
    names_no_rust_types(reason);
    toolset.shutdown().await;
    server.kill().await.unwrap();
}

#[tokio::test]
async fn a_session_the_server_forgot_is_made_again_at_once() {
    let fake = Fake::new("http-restart");
    for mode in ["json", "sse"] {
        let (mut server, config) = http_fake(&fake, &[mode]).await;
        let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
        let connection = toolset.shared.state.read().unwrap().connection;
        let out = toolset
            .call("restart", json!({}), &ToolContext::default())
            .await
            .unwrap();
        assert_eq!(out.text, "restarted", "{mode}");
        // The next call is refused on the old session (400, naming it): a new session is
        // made, and the call, which the server did not process, goes through on it.
        let started = Instant::now();
        let out = toolset
            .call("big", json!({"n": 5}), &ToolContext::default())
            .await
            .unwrap();
        assert!(!out.is_error, "{mode}: {}", out.text);
        assert_eq!(out.text, "BBBBB", "{mode}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{mode}: {:?}",
            started.elapsed()
        );
        assert_eq!(
            toolset.shared.state.read().unwrap().connection,
            connection,
            "{mode}: the connection was kept, with a new session"
        );
        toolset.shutdown().await;
        server.kill().await.unwrap();
    }
}

#[test]
fn environment_values_are_text_or_where_to_read_a_secret() {
    let env: BTreeMap<String, EnvValue> = serde_json::from_value(json!({
        "A": "text", "N": 5, "B": true, "S": {"env": "TOKEN"}
    }))
    .unwrap();
    assert_eq!(env["A"], EnvValue::Plain("text".into()));
    assert_eq!(env["N"], EnvValue::Plain("5".into()));
    assert_eq!(env["B"], EnvValue::Plain("true".into()));
    assert!(matches!(&env["S"], EnvValue::Secret(s) if s.env.as_deref() == Some("TOKEN")));
    // It said "data did not match any variant of untagged enum EnvValue".
    let error = serde_json::from_value::<EnvValue>(json!([1, 2]))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("a string, or where to read a secret"),
        "{error}"
    );
}

#[test]
fn a_chattering_server_is_logged_within_a_budget_that_says_what_it_left_out() {
    let start = Instant::now();
    let mut budget = StderrBudget::new();
    let logged = (0..10_000).filter(|_| budget.take(start).is_some()).count();
    assert_eq!(
        logged, STDERR_BURST as usize,
        "a burst, then nothing at once"
    );
    // A second later, ten more; the first says how many were left out.
    let later = start + Duration::from_secs(1);
    assert_eq!(budget.take(later), Some(10_000 - u64::from(STDERR_BURST)));
    let more = (0..100).filter(|_| budget.take(later).is_some()).count();
    assert_eq!(more, STDERR_PER_SECOND as usize - 1);
}

/// A server that serves a call at a time is not taken for a hung one while it works on a
/// long call.
#[tokio::test]
async fn a_call_given_up_on_does_not_cut_a_long_one_on_a_server_that_serves_one_at_a_time() {
    let fake = Fake::new("stdio-serial");
    let mut config = fake.config("good");
    config.timeout = Duration::from_secs(30);
    config.connect_timeout = Duration::from_secs(1);
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    let first = fake.pid();
    let connection = toolset.shared.state.read().unwrap().connection;
    let context = ToolContext::default();
    // Works for 4 s; meanwhile another call is given up on (its caller's deadline) past
    // the time that has the server probed, and the probe would wait behind the long call
    // for longer than `connect_timeout`.
    let long = toolset.call("nap", json!({"seconds": 4}), &context);
    let given_up = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dropped = tokio::time::timeout(
            PROBE_AFTER + Duration::from_millis(300),
            toolset.call("slow", json!({}), &context),
        )
        .await;
        assert!(dropped.is_err(), "{dropped:?}");
    };
    let (out, ()) = tokio::join!(long, given_up);
    let out = out.unwrap();
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(out.text, "done");
    // Probed once the long call ended: answered, nothing started again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(toolset.is_connected());
    assert_eq!(toolset.shared.state.read().unwrap().connection, connection);
    assert_eq!(fake.pid(), first);
    toolset.shutdown().await;
}

/// A stdio server that stops answering altogether (not merely slow on one call) is found
/// out by the call that timed out, and started again: later calls are answered.
#[tokio::test]
async fn a_hung_stdio_server_is_started_again() {
    // Its call timed out, or (as with every caller's default deadline, shorter than the
    // source's `timeout`) its caller gave up on it first.
    for given_up in [false, true] {
        hung_server_is_started_again(given_up).await;
    }
}

async fn hung_server_is_started_again(given_up: bool) {
    let fake = Fake::new("hang");
    // A server whose lists may be kept: the probe asks it all the same (rmcp's cache
    // would answer for the hung server).
    let mut config = fake.config("ttl");
    config.timeout = Duration::from_secs(if given_up { 30 } else { 1 });
    config.connect_timeout = Duration::from_secs(1);
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    let first = fake.pid();
    let context = ToolContext::default();
    let call = toolset.call("hang", json!({}), &context);
    if given_up {
        let dropped = tokio::time::timeout(Duration::from_millis(1500), call).await;
        assert!(dropped.is_err(), "{dropped:?}");
    } else {
        let out = call.await.unwrap();
        assert!(out.timed_out, "{out:?}");
    }
    eventually("a new server process", || {
        std::fs::read_to_string(fake.dir.join("pid"))
            .is_ok_and(|pid| pid.trim() != first.to_string())
    })
    .await;
    assert!(!alive(first), "the hung process is stopped");
    let started = Instant::now();
    loop {
        match toolset
            .call("echo", json!({"text": "back"}), &ToolContext::default())
            .await
        {
            Ok(out) if !out.is_error => {
                assert_eq!(out.text, "back");
                break;
            }
            other => {
                assert!(started.elapsed() < Duration::from_secs(20), "{other:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[tokio::test]
async fn one_request_answered_with_an_http_error_fails_that_call_alone() {
    let fake = Fake::new("http-one-fails");
    for mode in ["json", "sse"] {
        let (mut server, config) = http_fake(&fake, &[mode]).await;
        let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
        let connection = toolset.shared.state.read().unwrap().connection;
        // A call in flight while others fail beside it, on the same session.
        let ctx = ToolContext::default();
        let slow = toolset.call("slow", json!({}), &ctx);
        let failing = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let too_large = toolset
                .call("too_large", json!({}), &ToolContext::default())
                .await;
            let limited = toolset
                .call("rate_limited", json!({}), &ToolContext::default())
                .await;
            (too_large, limited)
        };
        let (slow, (too_large, limited)) = tokio::join!(slow, failing);
        let slow = slow.unwrap();
        assert!(!slow.is_error, "{mode}: {}", slow.text);
        assert_eq!(slow.text, "done", "{mode}");
        // A proxy's 413 answers that call: an error result naming the status, which
        // the model reads, not a server down (which the caller would send again).
        let too_large = too_large.unwrap();
        assert!(too_large.is_error, "{mode}");
        assert!(
            too_large.text.contains("HTTP 413"),
            "{mode}: {}",
            too_large.text
        );
        names_no_rust_types(&too_large.text);
        // A 429 ran nothing: UNAVAILABLE, not sent, after the server's Retry-After.
        let Err(CallError::Unavailable {
            reason,
            retry_after,
            sent,
            ..
        }) = &limited
        else {
            panic!("{mode}: {limited:?}");
        };
        assert!(reason.contains("HTTP 429"), "{mode}: {reason}");
        assert_eq!(*retry_after, Duration::from_secs(3), "{mode}");
        assert!(!sent, "{mode}");
        // The session went on: the server is connected, on the same connection.
        let out = toolset
            .call("big", json!({"n": 3}), &ToolContext::default())
            .await
            .unwrap();
        assert_eq!(out.text, "BBB", "{mode}");
        assert!(toolset.is_connected(), "{mode}");
        assert_eq!(
            toolset.shared.state.read().unwrap().connection,
            connection,
            "{mode}: the connection was kept"
        );
        toolset.shutdown().await;
        server.kill().await.unwrap();
    }
}

#[tokio::test]
async fn a_listing_ends_at_a_cursor_given_before_and_offers_schemaless_tools_as_objects() {
    let fake = Fake::new("http-cursor-loop");
    let (mut server, config) = http_fake(&fake, &["json", "loop"]).await;
    let started = Instant::now();
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    assert!(toolset.is_connected());
    // Two pages (the second names the first's cursor again), not a hundred.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let tools = toolset.list().await.unwrap();
    let mut names: Vec<&str> = tools.iter().map(|t| t.spec.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["fake__bare", "fake__big", "fake__nothing"]);
    let nothing = tools
        .iter()
        .find(|t| t.spec.name == "fake__nothing")
        .unwrap();
    assert_eq!(*nothing.spec.input_schema, json!({"type": "object"}));
    toolset.shutdown().await;
    server.kill().await.unwrap();
}

#[tokio::test]
async fn a_key_in_the_query_is_read_as_a_secret_and_never_shown() {
    let fake = Fake::new("http-query-key");
    let (mut server, mut config) = http_fake(&fake, &["json", "key"]).await;
    let secret = fake.dir.join("key");
    std::fs::write(&secret, "sesame\n").unwrap();
    config.query.insert(
        "apiKey".into(),
        SecretRef {
            env: None,
            file: Some(secret.clone()),
            prefix: String::new(),
        },
    );
    config.check().unwrap();
    let toolset = McpToolset::start(config.clone(), Changes::new())
        .await
        .unwrap();
    assert!(toolset.is_connected());
    let out = toolset
        .call("big", json!({"n": 2}), &ToolContext::default())
        .await
        .unwrap();
    assert_eq!(out.text, "BB");
    toolset.shutdown().await;

    // A key given in the URL itself is masked wherever the URL is shown.
    let url = config.url.clone().unwrap();
    config.query.clear();
    config.url = Some(format!("{url}?apiKey=wrong"));
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    assert!(!toolset.is_connected());
    let err = toolset
        .call("big", json!({"n": 2}), &ToolContext::default())
        .await
        .unwrap_err();
    let CallError::Unavailable { reason, .. } = &err else {
        panic!("{err:?}");
    };
    assert!(reason.contains("apiKey=***"), "{reason}");
    assert!(!reason.contains("wrong"), "{reason}");
    toolset.shutdown().await;
    server.kill().await.unwrap();
}

/// A server busy with a long call (one that answers nothing else meanwhile) is not taken
/// for a hung one by the check of its tools: the check waits while calls are in flight.
#[tokio::test]
async fn a_long_call_on_a_server_that_serves_one_at_a_time_is_not_cut_by_the_check() {
    let fake = Fake::new("http-serial");
    let (mut server, mut config) = http_fake(&fake, &["json", "serial"]).await;
    config.timeout = Duration::from_secs(30);
    config.connect_timeout = Duration::from_secs(1);
    let toolset = McpToolset::start(config, Changes::new()).await.unwrap();
    let connection = toolset.shared.state.read().unwrap().connection;
    // Longer than the check's period (10 s) and its bound (`connect_timeout`) together.
    let seconds = HTTP_CHECK_EVERY.as_secs() + 2;
    let out = toolset
        .call("slow", json!({"seconds": seconds}), &ToolContext::default())
        .await
        .unwrap();
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(out.text, "done");
    assert!(toolset.is_connected());
    assert_eq!(toolset.shared.state.read().unwrap().connection, connection);
    toolset.shutdown().await;
    server.kill().await.unwrap();
}
