// @forkd/sdk: a TypeScript client of forkd's REST API v1 (Controller, wire
// types of api/v1) and an E2B-shaped Sandbox over it. No runtime
// dependencies: global fetch over TCP, node:http over the unix socket.

/** The wire types of api/v1 (snake_case), as the Controller takes and returns them. */
export * as api from './types.js'
export * from './errors.js'
export {
  resolveConnection,
  defaultSocket,
  defaultDataDir,
  isLoopback,
  DEFAULT_ADDR,
  type Connection,
  type ConnectionOptions,
} from './connection.js'
export { retryAfterMs, type BodyData, type CallOptions, type RetryOptions, type RawResponse, type Transport } from './http.js'
export {
  Controller,
  eventBytes,
  type ControllerOptions,
  type DeleteSnapshotOptions,
  type EventStream,
  type ListSandboxesOptions,
  type WaitOptions,
} from './controller.js'
export * from './commands.js'
export * from './filesystem.js'
export * from './code.js'
export * from './sandbox.js'
