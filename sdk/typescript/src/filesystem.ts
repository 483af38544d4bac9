// Filesystem: E2B's `sbx.files` over forkd's file routes. Reads and writes
// stream: a file is never held whole unless asked for as text or bytes.

import type { Controller } from './controller.js'
import { NotFoundError } from './errors.js'
import type { BodyData } from './http.js'
import type { FileInfo } from './types.js'

/** The type of a guest path. */
export enum FileType {
  FILE = 'file',
  DIR = 'dir',
  SYMLINK = 'symlink',
  OTHER = 'other',
}

/** What a write made. */
export interface WriteInfo {
  name: string
  type?: FileType
  path: string
  /** Bytes written. */
  size?: number
}

/** One guest path, described. */
export interface EntryInfo extends WriteInfo {
  type: FileType
  size: number
  /** The mode bits (type and permissions, as Go's fs.FileMode). */
  mode: number
  /** Permissions as `rwxr-xr-x`. */
  permissions: string
  modifiedTime?: Date
  symlinkTarget?: string
}

/** A file for write(entries). */
export interface WriteEntry {
  path: string
  data: BodyData
}

export interface FilesystemRequestOpts {
  signal?: AbortSignal
}

export interface FilesystemWriteOpts extends FilesystemRequestOpts {
  /** Permission bits, e.g. 0o755 (default: keep an existing file's, or 0644). */
  mode?: number
}

export interface FilesystemListOpts extends FilesystemRequestOpts {
  /** Levels to list (default 1). */
  depth?: number
}

function permissions(mode: number): string {
  const bits = 'rwxrwxrwx'
  let s = ''
  for (let i = 0; i < 9; i++) s += mode & (1 << (8 - i)) ? bits[i] : '-'
  return s
}

function basename(p: string): string {
  const t = p.replace(/\/+$/, '')
  return t.slice(t.lastIndexOf('/') + 1)
}

/** toEntryInfo maps the wire FileInfo. */
export function toEntryInfo(f: FileInfo): EntryInfo {
  const type = (Object.values(FileType) as string[]).includes(f.type) ? (f.type as FileType) : FileType.OTHER
  const e: EntryInfo = { name: f.name, type, path: f.path, size: f.size, mode: f.mode, permissions: permissions(f.mode) }
  if (f.mtime) e.modifiedTime = new Date(f.mtime)
  if (f.target) e.symlinkTarget = f.target
  return e
}

/** Filesystem reads and writes the files of one sandbox. */
export class Filesystem {
  constructor(
    private readonly sandboxId: string,
    private readonly ctl: Controller,
  ) {}

  /** read returns a file's content: text (default), bytes, a Blob, or a stream (not held whole). */
  read(path: string, opts?: FilesystemRequestOpts & { format?: 'text' }): Promise<string>
  read(path: string, opts: FilesystemRequestOpts & { format: 'bytes' }): Promise<Uint8Array>
  read(path: string, opts: FilesystemRequestOpts & { format: 'blob' }): Promise<Blob>
  read(path: string, opts: FilesystemRequestOpts & { format: 'stream' }): Promise<ReadableStream<Uint8Array>>
  async read(
    path: string,
    opts: FilesystemRequestOpts & { format?: 'text' | 'bytes' | 'blob' | 'stream' } = {},
  ): Promise<string | Uint8Array | Blob | ReadableStream<Uint8Array>> {
    const o = { signal: opts.signal }
    switch (opts.format ?? 'text') {
      case 'stream':
        return this.ctl.readFile(this.sandboxId, path, o)
      case 'bytes':
        return this.ctl.readFileBytes(this.sandboxId, path, o)
      case 'blob':
        return new Blob([await this.ctl.readFileBytes(this.sandboxId, path, o)])
      default:
        return new TextDecoder().decode(await this.ctl.readFileBytes(this.sandboxId, path, o))
    }
  }

  /**
   * write replaces a file (made atomically, its parent directories too) with
   * data: text, bytes, a Blob, or a stream (ReadableStream, Node Readable,
   * any async iterable of bytes), streamed as it is read. With entries it
   * writes each.
   */
  write(path: string, data: BodyData, opts?: FilesystemWriteOpts): Promise<WriteInfo>
  write(files: WriteEntry[], opts?: FilesystemWriteOpts): Promise<WriteInfo[]>
  async write(
    pathOrFiles: string | WriteEntry[],
    dataOrOpts?: BodyData | FilesystemWriteOpts,
    opts: FilesystemWriteOpts = {},
  ): Promise<WriteInfo | WriteInfo[]> {
    if (Array.isArray(pathOrFiles)) {
      const o = (dataOrOpts as FilesystemWriteOpts | undefined) ?? {}
      const out: WriteInfo[] = []
      for (const f of pathOrFiles) out.push(await this.writeOne(f.path, f.data, o))
      return out
    }
    return this.writeOne(pathOrFiles, dataOrOpts as BodyData, opts)
  }

  private async writeOne(path: string, data: BodyData, o: FilesystemWriteOpts): Promise<WriteInfo> {
    const r = await this.ctl.writeFile(this.sandboxId, path, data, { signal: o.signal, mode: o.mode })
    return { name: basename(r.path), type: FileType.FILE, path: r.path, size: r.bytes }
  }

  /** list lists a directory (depth levels, default 1). */
  async list(path: string, opts: FilesystemListOpts = {}): Promise<EntryInfo[]> {
    return (await this.ctl.listDir(this.sandboxId, path, opts)).map(toEntryInfo)
  }

  /** exists reports whether a path exists. */
  async exists(path: string, opts: FilesystemRequestOpts = {}): Promise<boolean> {
    try {
      await this.ctl.stat(this.sandboxId, path, opts)
      return true
    } catch (err) {
      if (err instanceof NotFoundError) return false
      throw err
    }
  }

  /** getInfo describes a path (a final symlink is not followed). */
  async getInfo(path: string, opts: FilesystemRequestOpts = {}): Promise<EntryInfo> {
    return toEntryInfo(await this.ctl.stat(this.sandboxId, path, opts))
  }

  /** remove removes a file or a directory with everything in it. */
  remove(path: string, opts: FilesystemRequestOpts = {}): Promise<void> {
    return this.ctl.remove(this.sandboxId, path, { ...opts, recursive: true })
  }

  /** rename renames a path and describes its new name. */
  async rename(oldPath: string, newPath: string, opts: FilesystemRequestOpts = {}): Promise<EntryInfo> {
    await this.ctl.rename(this.sandboxId, oldPath, newPath, opts)
    return this.getInfo(newPath, opts)
  }

  /** makeDir makes a directory and its parents; false when it existed. */
  makeDir(path: string, opts: FilesystemRequestOpts = {}): Promise<boolean> {
    return this.ctl.makeDir(this.sandboxId, path, opts)
  }
}
