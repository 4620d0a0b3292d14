# Example (not run by the tests): bake kubelet-authenticator into a node image
# with Packer's Ansible provisioner and the kubelet_authenticator role. With
# kubernetes-sigs/image-builder, use node_custom_roles_post instead (see
# images/ansible/roles/kubelet_authenticator/README.md).
#
#   make build
#   packer init images/packer && packer build -var source_image=... images/packer
packer {
  required_plugins {
    qemu = {
      source  = "github.com/hashicorp/qemu"
      version = ">= 1.1.0"
    }
    ansible = {
      source  = "github.com/hashicorp/ansible"
      version = ">= 1.1.0"
    }
  }
}

variable "source_image" {
  type        = string
  description = "A cloud image of a Debian or Ubuntu release that already has kubelet and kubeadm (for example one built by image-builder)."
}

variable "source_image_checksum" {
  type    = string
  default = "none"
}

variable "bin_dir" {
  type        = string
  default     = "bin/linux_amd64"
  description = "Where make build left kubelet-authenticator (bin/linux_<arch>)."
}

variable "ssh_username" {
  type    = string
  default = "debian"
}

variable "ssh_private_key_file" {
  type = string
}

source "qemu" "node" {
  iso_url              = var.source_image
  iso_checksum         = var.source_image_checksum
  disk_image           = true
  format               = "qcow2"
  headless             = true
  output_directory     = "output-kubelet-authenticator"
  ssh_username         = var.ssh_username
  ssh_private_key_file = var.ssh_private_key_file
  shutdown_command     = "sudo shutdown -P now"
}

build {
  sources = ["source.qemu.node"]

  provisioner "ansible" {
    playbook_file = "${path.root}/../ansible/kubelet-authenticator.yml"
    roles_path    = "${path.root}/../ansible/roles"
    use_proxy     = false
    extra_arguments = [
      "--become",
      "-e", "kubelet_authenticator_binary_src=${abspath(var.bin_dir)}/kubelet-authenticator",
    ]
  }
}
