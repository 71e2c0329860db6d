import {
  MeshModel,
  MeshSummary,
  canRestart,
  formatAge,
  isAlert,
  panelRows,
  statusText
} from '../src/model';

function mesh(states: string[], extra: Partial<MeshSummary> = {}): MeshSummary {
  const ranks = states.map((state, rank) => ({
    rank,
    state,
    incarnation: rank === 1 ? 2 : 0,
    restarts: rank === 1 ? 2 : 0,
    pid: 1000 + rank,
    hb: rank === 3 ? null : 0.25 * rank
  }));
  return {
    world: states.length,
    backend: 'cpu',
    state: 'running',
    up: states.filter(s => s === 'ready' || s === 'busy').length,
    dead: states.filter(s => s === 'dead' || s === 'failed').length,
    ranks,
    ...extra
  };
}

describe('statusText', () => {
  it('is empty without a monarch_nb kernel and says none without a mesh', () => {
    expect(statusText(undefined)).toBe('');
    expect(statusText(null)).toBe('mesh: none');
  });
  it('counts ranks up', () => {
    expect(statusText(mesh(['ready', 'busy', 'ready', 'ready']))).toBe('mesh 4/4 ranks · cpu');
    expect(statusText(mesh(['ready', 'dead', 'ready', 'ready']))).toBe('mesh 3/4 ranks · cpu');
    expect(statusText(mesh(['ready', 'respawning']))).toBe('mesh 1/2 ranks · cpu');
  });
  it('says when the mesh stopped', () => {
    expect(statusText(mesh(['stopped', 'stopped'], { state: 'stopped', up: 0 }))).toBe(
      'mesh stopped · cpu'
    );
  });
});

describe('isAlert', () => {
  it('is red only while a rank of a running mesh is down', () => {
    expect(isAlert(undefined)).toBe(false);
    expect(isAlert(null)).toBe(false);
    expect(isAlert(mesh(['ready', 'busy']))).toBe(false);
    expect(isAlert(mesh(['ready', 'dead']))).toBe(true);
    expect(isAlert(mesh(['ready', 'respawning']))).toBe(true);
    expect(isAlert(mesh(['stopped', 'stopped'], { state: 'stopped', up: 0 }))).toBe(false);
  });
});

describe('panel', () => {
  it('has one row per rank: rank, state, incarnation, restarts, heartbeat', () => {
    const rows = panelRows(mesh(['ready', 'dead', 'busy', 'ready']));
    expect(rows).toEqual([
      ['0', 'ready', '0', '0', '0.0 s'],
      ['1', 'dead', '2', '2', '0.3 s'],
      ['2', 'busy', '0', '0', '0.5 s'],
      ['3', 'ready', '0', '0', '–']
    ]);
    expect(panelRows(null)).toEqual([]);
  });
  it('formats heartbeat ages', () => {
    expect(formatAge(null)).toBe('–');
    expect(formatAge(1.234)).toBe('1.2 s');
    expect(formatAge(42.6)).toBe('43 s');
  });
  it('offers restart only on a running mesh', () => {
    const m = mesh(['ready', 'dead']);
    expect(canRestart(m, m.ranks[1])).toBe(true);
    const s = mesh(['stopped'], { state: 'stopped' });
    expect(canRestart(s, s.ranks[0])).toBe(false);
  });
});

describe('MeshModel', () => {
  it('applies summaries, stacks and notices', () => {
    const model = new MeshModel();
    expect(model.mesh).toBeUndefined();
    expect(model.apply({ t: 'mesh', mesh: null })).toBe(true);
    expect(model.mesh).toBeNull();
    const m = mesh(['ready', 'ready']);
    model.apply({ t: 'mesh', mesh: m });
    expect(statusText(model.mesh)).toBe('mesh 2/2 ranks · cpu');
    model.apply({ t: 'stacks', text: 'ranks 0-1: main.py:3' });
    expect(model.stacks).toContain('ranks 0-1');
    model.apply({ t: 'error', text: 'rank 9 is out of range' });
    expect(model.notice).toBe('rank 9 is out of range');
    expect(model.noticeIsError).toBe(true);
    model.apply({ t: 'ack', text: 'restarting rank 1' });
    expect(model.noticeIsError).toBe(false);
    model.apply({ t: 'mesh', mesh: null }); // stopped: old stacks go
    expect(model.stacks).toBe('');
  });
  it('ignores what it does not know', () => {
    const model = new MeshModel();
    expect(model.apply(null)).toBe(false);
    expect(model.apply({ t: 'hello' })).toBe(false);
    expect(model.apply({ t: 'other' } as any)).toBe(false);
  });
  it('shows nothing after the comm closed', () => {
    const model = new MeshModel();
    model.apply({ t: 'mesh', mesh: mesh(['ready']) });
    model.disconnect();
    expect(model.mesh).toBeUndefined();
    expect(statusText(model.mesh)).toBe('');
  });
});
