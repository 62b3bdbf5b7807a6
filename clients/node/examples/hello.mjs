import { SandboxdClient } from "@sandboxd/client";

const client = new SandboxdClient({ url: process.env.SANDBOXD_URL, token: process.env.SANDBOXD_TOKEN });
await client.connect();
const lease = await client.leaseAcquire({ companyId: "acme", environmentId: "dev", provider: "bwrap" });
try {
  const channel = await client.open({ lease, command: ["sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.2; done"] });
  channel.pipe(process.stdout); // streamed as it comes; credit goes back as it is read
  channel.stderr.pipe(process.stderr);
  const exit = await channel.exit; // after the last byte
  console.log(`exit ${exit.exitCode} (${exit.outcome})`);
} finally {
  await client.leaseRelease({ leaseId: lease.id });
  client.close();
}
