// A tiny MCP session with forkd, as an AI agent's client would hold it:
// find (or build) a snapshot, spawn a sandbox, run a command, write and
// read a file, kill the sandbox. Run it with ./run (see README.md).
//
// By default it starts `forkd mcp` (FORKD_BIN, else forkd from PATH) over
// stdio, which goes through the daemon serving the data dir when one runs.
// With MCP_URL (e.g. http://127.0.0.1:8889/mcp) and FORKD_TOKEN it talks
// to forkd serve over streamable HTTP instead. MCP_SNAPSHOT names the
// snapshot to fork (default: the first ready one, else it builds
// "mcp-example" from the minimal image).
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const env = process.env;
const transport = env.MCP_URL
  ? new StreamableHTTPClientTransport(new URL(env.MCP_URL), {
      requestInit: { headers: { Authorization: `Bearer ${env.FORKD_TOKEN ?? ""}` } },
    })
  : new StdioClientTransport({ command: env.FORKD_BIN ?? "forkd", args: ["mcp"], env: { ...env }, stderr: "inherit" });

const client = new Client({ name: "forkd-mcp-session-example", version: "1.0.0" });
await client.connect(transport);

// call prints a tool call and its result's text, as a model would see it.
async function call(name, args) {
  console.log(`> ${name} ${JSON.stringify(args)}`);
  const res = await client.callTool({ name, arguments: args }, undefined, {
    timeout: 600_000,
    resetTimeoutOnProgress: true,
    onprogress: (p) => p.message && console.log(`  … ${p.message}`),
  });
  const text = res.content.filter((c) => c.type === "text").map((c) => c.text).join("\n");
  console.log(text.replace(/^/gm, "  "));
  if (res.isError) {
    throw new Error(`${name} failed`);
  }
  return res.structuredContent;
}

try {
  const { tools } = await client.listTools();
  console.log(`forkd offers ${tools.length} tools: ${tools.map((t) => t.name).join(", ")}`);

  let tag = env.MCP_SNAPSHOT;
  if (!tag) {
    const { snapshots } = await call("list_snapshots", {});
    tag = snapshots.find((s) => s.status === "ready" && !s.problem)?.tag;
  }
  if (!tag) {
    tag = "mcp-example";
    await call("create_snapshot", { tag, image: "minimal" });
  }

  const { sandboxes } = await call("spawn_sandboxes", { snapshot_tag: tag, timeout_secs: 300 });
  const id = sandboxes[0].id;
  try {
    await call("exec_command", { id, command: "uname -sr; echo running as $(id -un) in $(pwd)" });
    await call("write_file", { id, path: "/root/hello.sh", content: "#!/bin/sh\necho hello from $(hostname)\n", mode: "0755" });
    await call("exec_command", { id, args: ["/root/hello.sh"] });
    await call("read_file", { id, path: "/root/hello.sh" });
  } finally {
    await call("kill_sandbox", { id });
  }
} finally {
  await client.close();
}
