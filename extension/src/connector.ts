/**
 * One notebook's link to its kernel's mesh feed (the comm target
 * "monarch_nb.mesh", kernel side in monarch_nb/ui/labcomm.py).
 *
 * Both sides can open the comm: the kernel opens one to our target when
 * `%load_ext monarch_nb` runs (reaching an open page at once, even while the
 * cell goes on), and we open one to the kernel's target once per kernel
 * connection (a page opened or reloaded after `%load_ext`). Before
 * `%load_ext` the kernel has no target and closes ours; its own open comes
 * later. Nothing polls and no code is executed in the kernel.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';

import { MeshModel, TARGET, KernelMessage as FeedMessage } from './model';

export class Connector {
  readonly model = new MeshModel();
  private comm: Kernel.IComm | null = null;
  private kernel: Kernel.IKernelConnection | null = null;
  private listeners = new Set<() => void>();
  private disposed = false;

  constructor(readonly session: ISessionContext) {
    session.kernelChanged.connect(this.onKernelChanged, this);
    session.statusChanged.connect(this.onStatus, this);
    session.connectionStatusChanged.connect(this.onConnection, this);
    this.bind(session.session?.kernel ?? null);
  }

  onChange(fn: () => void): void {
    this.listeners.add(fn);
  }

  /** Ask the kernel for something (stacks, restart); false if not connected. */
  send(data: { action: string; rank?: number }): boolean {
    if (!this.comm) {
      return false;
    }
    this.comm.send(data as any);
    return true;
  }

  dispose(): void {
    this.disposed = true;
    this.session.kernelChanged.disconnect(this.onKernelChanged, this);
    this.session.statusChanged.disconnect(this.onStatus, this);
    this.session.connectionStatusChanged.disconnect(this.onConnection, this);
    this.drop();
    this.listeners.clear();
  }

  private emit(): void {
    for (const fn of this.listeners) {
      fn();
    }
  }

  private onKernelChanged(): void {
    this.bind(this.session.session?.kernel ?? null);
  }

  private bind(kernel: Kernel.IKernelConnection | null): void {
    if (kernel === this.kernel) {
      return;
    }
    if (this.kernel && !this.kernel.isDisposed) {
      this.kernel.removeCommTarget(TARGET, this.onKernelOpened);
    }
    this.drop();
    this.kernel = kernel;
    if (!kernel) {
      return;
    }
    kernel.registerCommTarget(TARGET, this.onKernelOpened);
    if (kernel.connectionStatus === 'connected') {
      this.open();
    }
  }

  private onConnection(_: unknown, status: Kernel.ConnectionStatus): void {
    if (status === 'connected' && !this.comm) {
      this.open();
    }
  }

  private onStatus(_: unknown, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      this.drop(); // the kernel's comms die with it; %load_ext opens a new one
    }
  }

  /** The kernel opened a comm to us (at `%load_ext monarch_nb`). */
  private onKernelOpened = (comm: Kernel.IComm, _msg: KernelMessage.ICommOpenMsg): void => {
    if (this.disposed) {
      comm.close();
      return;
    }
    this.adopt(comm);
    comm.send({ action: 'hello' });
  };

  /** Open a comm to the kernel's target (closed at once if monarch_nb is not loaded). */
  private open(): void {
    const kernel = this.kernel;
    if (!kernel || this.comm || kernel.isDisposed) {
      return;
    }
    try {
      const comm = kernel.createComm(TARGET);
      this.adopt(comm);
      comm.open({ action: 'hello' });
    } catch (err) {
      console.warn('monarch-nb-lab: cannot open the mesh comm', err);
    }
  }

  private adopt(comm: Kernel.IComm): void {
    const old = this.comm;
    this.comm = comm;
    if (old && old !== comm && !old.isDisposed) {
      old.close(); // one comm per notebook: the newest wins
    }
    comm.onMsg = msg => {
      if (this.comm === comm && this.model.apply(msg.content.data as unknown as FeedMessage)) {
        this.emit();
      }
    };
    comm.onClose = () => {
      if (this.comm === comm) {
        this.comm = null;
        this.model.disconnect();
        this.emit();
      }
    };
  }

  private drop(): void {
    const comm = this.comm;
    this.comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch {
        // the kernel is gone already
      }
    }
    this.model.disconnect();
    this.emit();
  }
}
