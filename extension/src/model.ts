/**
 * What the extension shows, as pure functions of the kernel's messages
 * (monarch_nb/ui/labcomm.py): the status-bar text and colour, the panel's rows,
 * and a small model that applies messages. No DOM, no JupyterLab: unit-tested
 * with jest (test/model.test.ts).
 */

export const TARGET = 'monarch_nb.mesh';

export interface RankRow {
  rank: number;
  state: string;
  incarnation: number;
  restarts: number;
  pid: number | null;
  hb: number | null; // heartbeat age, seconds
}

export interface MeshSummary {
  world: number;
  backend: string;
  state: 'running' | 'stopped';
  up: number;
  dead: number;
  ranks: RankRow[];
}

/** Kernel -> front end. */
export type KernelMessage =
  | { t: 'mesh'; mesh: MeshSummary | null }
  | { t: 'stacks'; text: string }
  | { t: 'ack'; text: string }
  | { t: 'error'; text: string }
  | { t: 'hello' };

/**
 * The status-bar text. `undefined`: no comm with a monarch_nb kernel (the
 * item is hidden); `null`: monarch_nb loaded, no mesh.
 */
export function statusText(mesh: MeshSummary | null | undefined): string {
  if (mesh === undefined) {
    return '';
  }
  if (mesh === null) {
    return 'mesh: none';
  }
  if (mesh.state !== 'running') {
    return `mesh stopped · ${mesh.backend}`;
  }
  return `mesh ${mesh.up}/${mesh.world} ranks · ${mesh.backend}`;
}

/** Red while a rank of a running mesh is not up (dead, respawning, failed). */
export function isAlert(mesh: MeshSummary | null | undefined): boolean {
  return !!mesh && mesh.state === 'running' && (mesh.up < mesh.world || mesh.dead > 0);
}

export function formatAge(hb: number | null): string {
  if (hb === null || hb === undefined) {
    return '–';
  }
  return hb < 10 ? `${hb.toFixed(1)} s` : `${Math.round(hb)} s`;
}

/** Column headers (short: the side panel is narrow); titles say them in full. */
export const COLUMNS = ['rank', 'state', 'inc', 'restarts', 'hb'];
export const COLUMN_TITLES = [
  'rank',
  'state',
  'incarnation: 0 for the first process, +1 per respawn or restart',
  'restarts of this rank',
  'age of the last heartbeat from the rank'
];

/** The panel's table: one row of cell texts per rank. */
export function panelRows(mesh: MeshSummary | null | undefined): string[][] {
  if (!mesh) {
    return [];
  }
  return mesh.ranks.map(r => [
    String(r.rank),
    r.state,
    String(r.incarnation),
    String(r.restarts),
    formatAge(r.hb)
  ]);
}

/** Whether the panel offers restart-rank for this row. */
export function canRestart(mesh: MeshSummary | null | undefined, row: RankRow): boolean {
  return !!mesh && mesh.state === 'running' && row.state !== 'stopped';
}

/** The state of one notebook's connection: last summary, stacks, notices. */
export class MeshModel {
  mesh: MeshSummary | null | undefined = undefined;
  stacks = '';
  notice = '';
  noticeIsError = false;

  /** Apply a kernel message; true if anything shown changed. */
  apply(msg: KernelMessage | null | undefined): boolean {
    if (!msg || typeof msg !== 'object') {
      return false;
    }
    switch (msg.t) {
      case 'mesh':
        this.mesh = msg.mesh;
        if (!msg.mesh || msg.mesh.state !== 'running') {
          this.stacks = '';
        }
        return true;
      case 'stacks':
        this.stacks = msg.text;
        this.notice = '';
        return true;
      case 'ack':
      case 'error':
        this.notice = msg.text;
        this.noticeIsError = msg.t === 'error';
        return true;
      default:
        return false;
    }
  }

  /** The comm closed (kernel restarted or shut down): show nothing. */
  disconnect(): void {
    this.mesh = undefined;
    this.stacks = '';
    this.notice = '';
  }
}
