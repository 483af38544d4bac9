// A real MCP client session against forkd's MCP server, with the official
// TypeScript SDK: the e2e test (e2e/mcp_test.go) runs it over stdio
// (`forkd mcp`) and over streamable HTTP (`forkd serve`'s /mcp) and reads
// its last stdout line, a JSON report.
//
// Environment:
//   MCP_TRANSPORT   stdio (spawn $FORKD_BIN mcp, with this environment) or http
//   FORKD_BIN       the forkd binary (stdio)
//   MCP_URL         http://127.0.0.1:PORT/mcp (http); FORKD_TOKEN its bearer token
//   MCP_CREATE      1: build the snapshots with create_snapshot first
//   MCP_MIN_TAG     a snapshot of the minimal image (exec, files)
//   MCP_PY_TAG      a snapshot of the python image (run_code)
//   MCP_BENCH       N: then time N calls of exec_command `true`
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import Ajv2020 from "ajv/dist/2020.js";

const env = process.env;
const report = { ok: false, transport: env.MCP_TRANSPORT, steps: [], progress: {} };
const tools = [
  "branch_sandbox", "create_snapshot", "exec_command", "fork_sandbox", "get_sandbox", "kill_sandbox", "list_files",
  "list_sandboxes", "list_snapshots", "publish_port", "read_file", "run_code", "set_egress", "spawn_sandboxes",
  "wait_for_text", "write_file",
];

function check(cond, what, detail) {
  if (!cond) {
    throw new Error(`${what}${detail === undefined ? "" : ": " + JSON.stringify(detail).slice(0, 2000)}`);
  }
}

function step(name) {
  report.steps.push(name);
  process.stderr.write(`mcp-client: ${name}\n`);
}

function transport() {
  if (env.MCP_TRANSPORT === "http") {
    return new StreamableHTTPClientTransport(new URL(env.MCP_URL), {
      requestInit: { headers: { Authorization: `Bearer ${env.FORKD_TOKEN}` } },
    });
  }
  return new StdioClientTransport({ command: env.FORKD_BIN, args: ["mcp"], env: { ...env }, stderr: "inherit" });
}

// call calls a tool and returns its result; a failed call (isError) is
// returned too, for the caller to check.
async function call(client, name, args, opts = {}) {
  const progress = [];
  const res = await client.callTool({ name, arguments: args }, undefined, {
    timeout: 600_000,
    resetTimeoutOnProgress: true,
    onprogress: (p) => progress.push(p.message ?? String(p.progress)),
  });
  if (progress.length) {
    report.progress[name] = (report.progress[name] ?? []).concat(progress);
  }
  const text = (res.content ?? []).filter((c) => c.type === "text").map((c) => c.text).join("\n");
  if (!opts.mayFail) {
    check(!res.isError, `${name} failed`, text);
  }
  return { ...res, text, data: res.structuredContent };
}

const client = new Client({ name: "forkd-e2e", version: "1.0.0" });

async function main() {
  await client.connect(transport());
  const info = client.getServerVersion();
  check(info?.name === "forkd", "server name", info);
  step("initialize");

  // Every tool is there, each with a description and input and output
  // schemas that compile as JSON Schema (draft 2020-12, strict).
  const { tools: listed } = await client.listTools();
  const names = listed.map((t) => t.name).sort();
  check(JSON.stringify(names) === JSON.stringify(tools), "tools", names);
  const ajv = new Ajv2020({ strict: true, allowUnionTypes: true });
  for (const t of listed) {
    check(t.description && t.description.length > 40, `${t.name}: description`, t.description);
    for (const [kind, schema] of [["input", t.inputSchema], ["output", t.outputSchema]]) {
      check(schema && schema.type === "object", `${t.name}: ${kind} schema is an object`, schema);
      try {
        ajv.compile(schema);
      } catch (e) {
        throw new Error(`${t.name}: ${kind} schema does not compile: ${e.message}`);
      }
    }
    check(t.inputSchema.additionalProperties === false, `${t.name}: closed input schema`, t.inputSchema);
    for (const [p, s] of Object.entries(t.inputSchema.properties ?? {})) {
      check(s.description, `${t.name}.${p}: description`, s);
    }
  }
  report.tools = listed.length;
  step("list tools");

  const minTag = env.MCP_MIN_TAG;
  const pyTag = env.MCP_PY_TAG;
  if (env.MCP_CREATE === "1") {
    for (const [tag, image] of [[minTag, "minimal"], [pyTag, "python"]]) {
      const r = await call(client, "create_snapshot", { tag, image });
      check(r.data.status === "ready" && r.data.snapshot.tag === tag, "create_snapshot", r.data);
    }
    check((report.progress.create_snapshot ?? []).length > 0, "create_snapshot reported progress");
    step("create_snapshot");
  }
  const snaps = (await call(client, "list_snapshots", {})).data.snapshots;
  for (const tag of [minTag, pyTag]) {
    check(snaps.some((s) => s.tag === tag && s.status === "ready"), `snapshot ${tag} listed ready`, snaps);
  }
  step("list_snapshots");

  // spawn → exec → files → kill, on the minimal image.
  const spawned = await call(client, "spawn_sandboxes", { snapshot_tag: minTag, n: 1, timeout_secs: 900, metadata: { by: "mcp-e2e" } });
  check(spawned.data.sandboxes.length === 1, "spawn", spawned.data);
  const id = spawned.data.sandboxes[0].id;
  check(/^sb-[a-z2-7]{10}$/.test(id) && spawned.data.sandboxes[0].status === "running", "spawned sandbox", spawned.data);
  step("spawn_sandboxes");

  let r = await call(client, "exec_command", { id, command: "echo hello; echo oops >&2; exit 3" });
  check(r.data.exit_code === 3 && r.data.stdout === "hello\n" && r.data.stderr === "oops\n" && !r.isError, "exec shell", r.data);
  r = await call(client, "exec_command", { id, args: ["cat"], stdin: "from stdin", cwd: "/tmp", env: { A: "b" } });
  check(r.data.exit_code === 0 && r.data.stdout === "from stdin", "exec args with stdin", r.data);
  r = await call(client, "exec_command", { id, command: "head -c 300000 /dev/zero | tr '\\0' x" });
  check(r.data.truncated === true && r.data.stdout_bytes === 300000 && r.data.stdout.includes("300000 bytes in all"), "exec truncates", {
    ...r.data, stdout: r.data.stdout.length,
  });
  step("exec_command");

  const body = "héllo from mcp\nline 2\n";
  r = await call(client, "write_file", { id, path: "/root/mcp/hello.txt", content: body });
  check(r.data.bytes === Buffer.byteLength(body), "write_file", r.data);
  r = await call(client, "read_file", { id, path: "/root/mcp/hello.txt" });
  check(r.data.content === body && r.data.size === Buffer.byteLength(body), "read_file", r.data);
  r = await call(client, "list_files", { id, path: "/root/mcp" });
  check(r.data.entries.some((e) => e.path === "/root/mcp/hello.txt" && e.type === "file"), "list_files", r.data);
  step("write_file, read_file, list_files");

  // wait_for_text reads the file; a marker is never run.
  await call(client, "write_file", { id, path: "/tmp/app.log", content: "booting\nREADY on 8080\n" });
  r = await call(client, "wait_for_text", { id, path: "/tmp/app.log", text: "READY", timeout_secs: 10 });
  check(r.data.found && r.data.line === "READY on 8080", "wait_for_text", r.data);
  r = await call(client, "wait_for_text", { id, path: "/tmp/app.log", text: "$(touch /tmp/pwned)`touch /tmp/pwned`", timeout_secs: 1 }, { mayFail: true });
  check(r.isError && r.text.startsWith("deadline_exceeded"), "wait_for_text times out", r.text);
  r = await call(client, "exec_command", { id, args: ["ls", "/tmp/pwned"] });
  check(r.data.exit_code !== 0, "the marker ran", r.data);
  step("wait_for_text");

  // Errors come back as tool results the model can act on.
  r = await call(client, "get_sandbox", { id: "sb-zzzzzzzzzz" }, { mayFail: true });
  check(r.isError && r.text.startsWith("not_found") && r.text.includes("list_sandboxes"), "error for a missing sandbox", r.text);
  r = await call(client, "exec_command", { id }, { mayFail: true });
  check(r.isError && r.text.startsWith("invalid_argument") && r.text.includes("command"), "error for bad arguments", r.text);
  r = await call(client, "read_file", { id, path: "relative.txt" }, { mayFail: true });
  check(r.isError && r.text.includes("relative"), "error for a relative path", r.text);
  step("errors are isError results");

  // Resources.
  const { resources } = await client.listResources();
  check(["forkd://sandboxes", "forkd://snapshots"].every((u) => resources.some((x) => x.uri === u)), "resources", resources);
  const { resourceTemplates } = await client.listResourceTemplates();
  check(resourceTemplates.some((x) => x.uriTemplate === "forkd://sandboxes/{id}"), "resource templates", resourceTemplates);
  const res = await client.readResource({ uri: `forkd://sandboxes/${id}` });
  check(JSON.parse(res.contents[0].text).id === id, "read a sandbox resource", res);
  step("resources");

  // run_code keeps state in the warm interpreter, on the python image.
  const py = (await call(client, "spawn_sandboxes", { snapshot_tag: pyTag, timeout_secs: 900 })).data.sandboxes[0].id;
  await call(client, "run_code", { id: py, code: "x = 41" });
  r = await call(client, "run_code", { id: py, code: "print('side'); x + 1" });
  check(r.data.value === "42" && r.data.stdout === "side\n", "run_code keeps state", r.data);
  r = await call(client, "run_code", { id: py, code: "import numpy\nfloat(numpy.arange(4).sum())" });
  check(r.data.value === "6.0", "run_code with numpy", r.data);
  r = await call(client, "run_code", { id: py, code: "1/0" });
  check(r.data.error?.name === "ZeroDivisionError" && !r.isError, "run_code exception", r.data);
  r = await call(client, "run_code", { id, code: "1" }, { mayFail: true });
  check(r.isError && r.text.startsWith("not_implemented"), "run_code without Python", r.text);
  step("run_code");

  if (env.MCP_BENCH) {
    const n = Number(env.MCP_BENCH);
    const ms = [];
    for (let i = 0; i < n + 3; i++) {
      const t0 = process.hrtime.bigint();
      const b = await call(client, "exec_command", { id, args: ["true"] });
      const dt = Number(process.hrtime.bigint() - t0) / 1e6;
      check(b.data.exit_code === 0, "bench exec", b.data);
      if (i >= 3) ms.push(dt); // the first calls warm up
    }
    report.bench_ms = ms;
    step("bench");
  }

  for (const sb of [id, py]) {
    r = await call(client, "kill_sandbox", { id: sb });
    check(r.data.killed, "kill_sandbox", r.data);
  }
  r = await call(client, "get_sandbox", { id }, { mayFail: true });
  check(r.isError && r.text.startsWith("not_found"), "killed sandbox is gone", r.text);
  step("kill_sandbox");

  report.ok = true;
}

try {
  await main();
} catch (e) {
  report.error = String(e?.stack ?? e);
}
// Closing ends forkd mcp (stdio) too; a failed session must not leave
// either running.
await client.close().catch(() => {});
process.stdout.write(JSON.stringify(report) + "\n", () => process.exit(report.ok ? 0 : 1));
