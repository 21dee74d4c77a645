// A harness that answers MCP elicitation with the TypeScript SDK client (npm
// @modelcontextprotocol/sdk, the one .ci/install-mcp-servers installs with server-everything):
// it spawns sharedos-mcp-shim, declares form-mode elicitation, answers every question as the
// person would, makes the calls and prints a JSON report as its last line.
//
// Env: MCP_SDK_DIR (the SDK package folder), SHAREDOS_SHIM, SHAREDOS_TURN_TOKEN, SHAREDOS_BROKER
// (for the shim); ELICIT_ANSWER: approve | deny | decline | cancel; ELICIT_CALLS: a JSON list of
// [tool, arguments].
const path = require("path");
const sdk = process.env.MCP_SDK_DIR;
const { Client } = require(path.join(sdk, "dist/cjs/client/index.js"));
const { StdioClientTransport } = require(path.join(sdk, "dist/cjs/client/stdio.js"));
const { ElicitRequestSchema } = require(path.join(sdk, "dist/cjs/types.js"));

async function main() {
  const answer = process.env.ELICIT_ANSWER || "approve";
  const calls = JSON.parse(process.env.ELICIT_CALLS || "[]");
  const questions = [];
  const transport = new StdioClientTransport({
    command: process.env.SHAREDOS_SHIM,
    args: [],
    env: process.env,
    stderr: "inherit",
  });
  const client = new Client(
    { name: "ts-sdk-harness", version: "1.0.0" },
    { capabilities: { elicitation: { form: {} } } },
  );
  client.setRequestHandler(ElicitRequestSchema, async (request) => {
    questions.push(request.params);
    const props = (request.params.requestedSchema || {}).properties || {};
    if (answer === "decline" || answer === "cancel") return { action: answer };
    if ("decision" in props) {
      return { action: "accept", content: { decision: answer === "approve" ? "approve" : "deny" } };
    }
    const content = {};
    for (const [k, p] of Object.entries(props)) {
      if (p.type === "boolean") content[k] = true;
      else if (p.type === "string") content[k] = (p.enum || ["x"])[0];
    }
    return { action: "accept", content };
  });
  await client.connect(transport);
  const report = { protocol: transport._protocolVersion || null, calls: [] };
  for (const [tool, args] of calls) {
    const r = await client.callTool({ name: tool, arguments: args }, undefined, { timeout: 60000 });
    const text = r.content && r.content[0] ? r.content[0].text : "";
    const meta = (r._meta || {}).sharedos || {};
    report.calls.push([!!r.isError, text, meta.code || null]);
  }
  report.server = client.getServerVersion();
  report.questions = questions;
  await client.close();
  console.log(JSON.stringify(report));
}

main().catch((e) => {
  console.error(`error: ${e && e.stack ? e.stack : e}`);
  process.exit(1);
});
